"""Scaling the decode Deployment under load: by hand (``kubectl scale`` 1 -> 2 -> 1) and by the
chart's autoscaler through the API server with its Role, which forbids everything else.

The new pod takes requests once Ready; the scale-down drains the pod the ReplicaSet removes
(deregistered first, its streams finished within the grace period); no request is lost."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from tests.conftest import poll_until
from tests.k8s.load import Load

pytestmark = pytest.mark.k8s
CONCURRENCY = 6


def generated(node, pod) -> int:
    return node.worker_stats("decode", pod).num_generated_tokens


def held(node, pod) -> int:
    try:
        stats = node.worker_stats("decode", pod, timeout_s=3)
    except Exception:  # noqa: BLE001 - already stopped: it holds nothing
        return 0
    return stats.num_requests_running + stats.num_requests_waiting


async def up_then_down(node, load: Load, scale_up, scale_down) -> dict:
    """Under ``load``: ``scale_up()``, the new decode pod Ready and generating, ``scale_down()``,
    one pod drained and gone. Returns the numbers of both steps."""
    await load.wait_for(lambda: load.first_tokens >= CONCURRENCY, "the load running")
    before = {p.name for p in node.pods("decode")}
    await asyncio.to_thread(scale_up)
    up_s = time.time()

    def new_pod_generating():
        new = [p for p in node.pods("decode") if p.name not in before and p.ready_s is not None]
        return new[0] if new and generated(node, new[0]) > 0 else None

    await load.wait_for(new_pod_generating, "the new decode pod generating", timeout_s=600)
    new = await asyncio.to_thread(new_pod_generating)
    up_to_serving_s = time.time() - up_s
    await asyncio.to_thread(scale_down)
    down_s = time.time()
    leaving = {}

    def one_terminating() -> bool:
        going = [p for p in node.pods("decode") if p.deleting]
        if going and not leaving:
            leaving["pod"], leaving["held"] = going[0], held(node, going[0])
        return bool(leaving)

    await load.wait_for(one_terminating, "a decode pod terminating", timeout_s=120)
    gone_s = await asyncio.to_thread(node.wait_pod_gone, "decode", leaving["pod"].name)
    return {"new_pod_time_to_ready_s": new.time_to_ready_s, "new_pod_serving_after_s": round(up_to_serving_s, 1),
            "new_pod_generated_tokens": generated(node, new) if not leaving["pod"].name == new.name else None,
            "drained_pod": "the new one" if leaving["pod"].name == new.name else "the old one",
            "drained_pod_held_requests": leaving["held"], "drain_s": round(gone_s - down_s, 1)}


def test_kubectl_scale_decode_1_2_1_under_load(baseline, references, record):
    node = baseline

    async def run():
        async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
            numbers = await up_then_down(node, load, lambda: node.scale("decode", 2), lambda: node.scale("decode", 1))
            served = len(load.outcomes)
            await load.wait_for(lambda: len(load.outcomes) >= served + CONCURRENCY, "requests after the scale-down")
            load.stop()
            return {**(await load.finish()).as_dict(), **numbers}

    numbers = asyncio.run(run())
    record("kubectl scale decode 1 -> 2 -> 1 under load", **numbers)
    assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
    assert numbers["sent"] == numbers["completed"]


# Run inside the autoscaler pod with its own ServiceAccount token: the HTTP status of each call.
RBAC_PROBE = """
import json, os, sys, httpx
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
decode, router, pod = sys.argv[1:]
ns = open(f"{sa}/namespace").read()
api = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
client = httpx.Client(verify=f"{sa}/ca.crt", timeout=10,
                      headers={"Authorization": "Bearer " + open(f"{sa}/token").read()})
apps, core = f"{api}/apis/apps/v1/namespaces/{ns}/deployments", f"{api}/api/v1/namespaces/{ns}"
merge = {"Content-Type": "application/merge-patch+json"}
print(json.dumps({
    "get decode scale": client.get(f"{apps}/{decode}/scale").status_code,
    "get router scale": client.get(f"{apps}/{router}/scale").status_code,
    "patch router scale": client.patch(f"{apps}/{router}/scale", json={"spec": {"replicas": 3}}, headers=merge).status_code,
    "patch decode deployment": client.patch(f"{apps}/{decode}", json={"metadata": {"labels": {"x": "y"}}},
                                            headers=merge).status_code,
    "delete decode pod": client.delete(f"{core}/pods/{pod}").status_code,
    "list pods": client.get(f"{core}/pods").status_code,
    "list secrets": client.get(f"{core}/secrets").status_code,
}))
"""


def test_autoscaler_scales_decode_with_its_role_and_the_role_forbids_the_rest(baseline, references, record):
    node = baseline
    revision = node.revision()
    # Targets of its own: any loaded step beats a 20 ms TBT target (the router keeps no SLO).
    node.helm_upgrade("autoscaler.enabled=true", "autoscaler.slo.tbtMs=20", "autoscaler.slo.ttftMs=60000",
                      "autoscaler.cooldownS=20", "autoscaler.intervalS=2")
    try:
        (scaler,) = node.pods("autoscaler")
        (decode_pod,) = node.pods("decode")
        rbac = json.loads(node.kubectl("exec", scaler.name, "--", "python", "-c", RBAC_PROBE,
                                       node.deployment("decode"), node.deployment("router"), decode_pod.name))
        assert rbac == {"get decode scale": 200, "get router scale": 403, "patch router scale": 403,
                        "patch decode deployment": 403, "delete decode pod": 403, "list pods": 403,
                        "list secrets": 403}
        assert node.pods("decode")[0].name == decode_pod.name  # the forbidden delete deleted nothing

        async def run():
            async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
                numbers = await up_then_down(
                    node, load, lambda: None,  # the autoscaler scales up: nothing to do but wait
                    lambda: load.stop())  # and down once the load is over
                return {**(await load.finish()).as_dict(), **numbers}

        started_s = time.time()
        numbers = asyncio.run(run())
        numbers["replicas_at_end"] = node.replicas("decode")
        logs = node.kubectl("logs", scaler.name)
        numbers["autoscaler_log"] = [line[-160:] for line in logs.splitlines() if "decode" in line and "->" in line]
        numbers["rbac"] = rbac
        numbers["test_s"] = round(time.time() - started_s, 1)
        record("autoscaler: decode 1 -> 2 -> 1 through the API server", **numbers)
        assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
        assert numbers["replicas_at_end"] == 1
    finally:
        node.helm("rollback", node.release, str(revision), "--wait", "--timeout", "15m")
        poll_until(lambda: not node.pods("autoscaler"), timeout_s=120, interval_s=1.0, message="autoscaler gone")
        try:
            node.scale("decode", 1)
        except subprocess.CalledProcessError:
            pass
