"""Silent partitions between pods in the middle of a load (chaos.netfilter: DROP rules between
pod addresses in the TANDEM-CHAOS chain of the node's netfilter), each healed after
``PARTITION_S``:

- the routers ↔ one of two decode pods: a split view (it still heartbeats to Redis); the routers
  mark it down by their keepalives and migrate its streams, then take it back;
- a decode pod ↔ the pool pod: its KV loads fail and it recomputes;
- the routers ↔ the Redis pod: they serve from their last view.

Every request completes with the Hugging Face answer (lost 0, wrong 0); the numbers (detection
from the routers' logs, time until the healed decode pod serves again) go to the report. The
chain is removed after each proof, and before the first (what a killed run left).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from chaos.campaign import detect_s
from chaos.netfilter import Netfilter, signals_raise
from tests.k8s.load import Load

pytestmark = pytest.mark.k8s
CONCURRENCY = 6
PARTITION_S = 12.0


@pytest.fixture
def netfilter():
    rules = Netfilter()
    rules.cleanup()
    with signals_raise():  # SIGTERM too runs the finally below
        try:
            yield rules
        finally:
            rules.cleanup()
    assert rules.rules() == [] and rules.jumps() == []


def served(node, pod) -> int:
    return node.worker_stats("decode", pod).num_generated_tokens


async def partitioned_run(node, netfilter: Netfilter, pairs: list[tuple[str, str]], served_by=None) -> dict:
    """Continuous load; once it streams, drops the packets between each (client, server) address
    pair for PARTITION_S, heals, then (with ``served_by``, a count of what the partitioned pod
    served) runs until that count grows past its value at the heal; returns the load's tally, when
    the partition started (time.time()) and how long after the heal the pod served again."""
    async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
        await load.wait_for(lambda: load.first_tokens >= 2 * CONCURRENCY, "a steady load")
        started_s = time.time()
        partitions = [await asyncio.to_thread(netfilter.partition, a, b) for a, b in pairs]
        try:
            await asyncio.sleep(PARTITION_S)  # the partition's duration, not a wait for an event
        finally:
            for partition in partitions:
                await asyncio.to_thread(netfilter.heal, partition)
        healed_s = time.time()
        back_s = None
        if served_by is not None:
            at_heal = await asyncio.to_thread(served_by)
            await load.wait_for(lambda: served_by() > at_heal, "the healed pod serving again", timeout_s=120)
            back_s = round(time.time() - healed_s, 1)
        load.stop()
        tally = await load.finish()
    return {**tally.as_dict(), "started_s": started_s, "serving_again_after_s": back_s}


def router_logs(node, tmp_path: Path) -> list[Path]:
    paths = []
    for pod in node.pods("router"):
        path = tmp_path / f"{pod.name}.log"
        path.write_text(node.kubectl("logs", pod.name))
        paths.append(path)
    return paths


def test_a_decode_pod_the_routers_cannot_reach(baseline, references, record, netfilter, tmp_path):
    node = baseline
    node.scale("decode", 2)
    try:
        node.wait_serving(prefill=1, decode=2)
        victim = node.pods("decode")[0]
        pairs = [(router.ip, victim.ip) for router in node.pods("router")]
        numbers = asyncio.run(partitioned_run(node, netfilter, pairs, lambda: served(node, victim)))
        numbers["detected_s"] = detect_s(router_logs(node, tmp_path), ("marked down", victim.ip),
                                         numbers.pop("started_s"))
        record("partition: routers <-> decode pod (1 of 2), a split view", **numbers)
        assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
        assert numbers["detected_s"] is not None and numbers["detected_s"] <= 10.0
    finally:
        node.scale("decode", 1)


def test_a_decode_pod_cut_from_the_pool(baseline, references, record, netfilter):
    node = baseline
    (decode,) = node.pods("decode")
    pairs = [(decode.ip, pool.ip) for pool in node.pods("kv-pool")]
    numbers = asyncio.run(partitioned_run(node, netfilter, pairs))
    numbers.pop("started_s")
    record("partition: decode pod <-> pool pod", **numbers)
    assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]


def test_the_routers_cut_from_redis(baseline, references, record, netfilter, tmp_path):
    node = baseline
    pairs = [(router.ip, redis.ip) for router in node.pods("router") for redis in node.pods("redis")]
    numbers = asyncio.run(partitioned_run(node, netfilter, pairs))
    numbers["detected_s"] = detect_s(router_logs(node, tmp_path), ("cannot read the worker registry",),
                                     numbers.pop("started_s"))
    record("partition: routers <-> Redis pod", **numbers)
    assert (numbers["lost"], numbers["wrong"]) == (0, 0), numbers["errors"]
