"""``kubectl delete pod`` of a worker in the middle of a load: of the decode worker holding streams
(one of two), and of the prefill worker (the only one). The pod gets preStop, SIGTERM and its
grace period: it deregisters, drains what it holds and exits; the Deployment starts a replacement.
Every request completes with the Hugging Face answer (lost 0, wrong 0), and the replacement takes
requests once Ready."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.k8s.load import Load

pytestmark = pytest.mark.k8s
CONCURRENCY = 6


def running(node, role: str, pod) -> int:
    stats = node.worker_stats(role, pod)
    return stats.num_requests_running + stats.num_requests_waiting


def served(node, role: str, pod) -> int:
    """Tokens the worker in ``pod`` has computed: prompt tokens (prefill), generated (decode)."""
    stats = node.worker_stats(role, pod)
    return stats.num_prefill_tokens if role == "prefill" else stats.num_generated_tokens


async def delete_mid_run(node, role: str, victims: list) -> dict:
    """Continuous load; deletes the pod of ``victims`` holding the most requests once it holds
    some; goes on until the replacement is Ready and has served; returns the numbers."""
    async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
        held = {}

        def victim_busy() -> bool:
            held.update({p.name: running(node, role, p) for p in victims})
            return load.first_tokens >= CONCURRENCY and max(held.values()) > 0

        await load.wait_for(victim_busy, f"a {role} pod holding requests")
        victim = max(victims, key=lambda p: held[p.name])
        deleted_s = time.time()
        await asyncio.to_thread(node.delete_pod, victim.name)
        old = {p.name for p in victims}

        def replacement_serving() -> bool:
            new = [p for p in node.pods(role) if p.name not in old and p.ready_s is not None]
            return bool(new) and served(node, role, new[0]) > 0

        await load.wait_for(replacement_serving, f"the replacement {role} pod serving", timeout_s=600)
        gone_s = await asyncio.to_thread(node.wait_pod_gone, role, victim.name)
        load.stop()
        tally = await load.finish()
    (replacement,) = [p for p in node.pods(role) if p.name not in old]
    return {**tally.as_dict(), "victim_held_requests": held[victim.name],
            "victim_drain_s": round(gone_s - deleted_s, 1), "replacement_time_to_ready_s": replacement.time_to_ready_s,
            "replacement_served_tokens": served(node, role, replacement)}


def test_delete_the_decode_pod_holding_streams(baseline, references, record):
    node = baseline
    node.scale("decode", 2)
    try:
        node.wait_serving(prefill=1, decode=2)
        numbers = asyncio.run(delete_mid_run(node, "decode", node.pods("decode")))
        record("kubectl delete pod: decode (1 of 2) holding streams", **numbers)
        assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
        assert numbers["victim_held_requests"] > 0 and numbers["replacement_served_tokens"] > 0
    finally:
        node.scale("decode", 1)


def test_delete_the_prefill_pod_mid_run(baseline, references, record):
    node = baseline
    fallbacks_before = node.metric("tandem:colocated_fallbacks_total")
    numbers = asyncio.run(delete_mid_run(node, "prefill", node.pods("prefill")))
    numbers["colocated_fallbacks"] = node.metric("tandem:colocated_fallbacks_total") - fallbacks_before
    record("kubectl delete pod: prefill (the only one) mid-run", **numbers)
    assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
    assert numbers["victim_held_requests"] > 0 and numbers["replacement_served_tokens"] > 0
