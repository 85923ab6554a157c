"""``helm upgrade`` that changes a worker flag (both workers' --num-kv-blocks) under load: a rolling
update of the prefill and decode Deployments (maxSurge 1: the new pod is Ready before the old one
gets preStop and SIGTERM and drains within terminationGracePeriodSeconds). Lost 0, wrong 0."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.k8s.load import Load

pytestmark = pytest.mark.k8s
CONCURRENCY = 6
ROLES = ("prefill", "decode")


def served(node, role: str, pod) -> int:
    stats = node.worker_stats(role, pod)
    return stats.num_prefill_tokens if role == "prefill" else stats.num_generated_tokens


def test_helm_upgrade_rolls_the_workers_under_load(baseline, references, record):
    node = baseline
    revision = node.revision()
    old = {role: {p.name for p in node.pods(role)} for role in ROLES}

    async def run():
        async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
            await load.wait_for(lambda: load.first_tokens >= CONCURRENCY, "the load running")
            started_s = time.time()
            await asyncio.to_thread(node.helm_upgrade, "prefill.numKvBlocks=240", "decode.numKvBlocks=480")
            helm_s = time.time() - started_s

            def rolled_and_serving() -> bool:
                for role in ROLES:
                    pods = node.pods(role)
                    if {p.name for p in pods} & old[role] or len(pods) != 1 or served(node, role, pods[0]) == 0:
                        return False
                return True

            await load.wait_for(rolled_and_serving, "old worker pods gone, new ones serving", timeout_s=600)
            rolled_s = time.time() - started_s
            load.stop()
            tally = await load.finish()
        new = {role: node.pods(role)[0] for role in ROLES}
        return {**tally.as_dict(), "helm_upgrade_wait_s": round(helm_s, 1),
                "rollout_until_old_pods_gone_s": round(rolled_s, 1),
                **{f"new_{role}_time_to_ready_s": new[role].time_to_ready_s for role in ROLES}}

    try:
        numbers = asyncio.run(run())
        record("helm upgrade: workers rolled under load", **numbers)
        assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
        for role, flag in (("prefill", "240"), ("decode", "480")):
            env = node.kubectl_json("get", "deployment", node.deployment(role))["spec"]["template"]["spec"]["containers"][0]["env"]
            assert {"name": f"TANDEM_{role.upper()}_NUM_KV_BLOCKS", "value": flag} in env
    finally:
        node.helm("rollback", node.release, str(revision), "--wait", "--timeout", "15m")
