"""Tensor-parallel workers in a real cluster: prefill and decode at different TP degrees
through the pool, greedy-equal to Hugging Face; and a TP=2 decode worker losing a rank mid-stream.

Two clusters (TP=2 on this machine: two gloo ranks of one thread each): prefill TP=2 with a TP=1
decode worker; and prefill TP=1 with two TP=2 decode workers, where the equality proof runs
first and the rank kill after it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest
import redis

from core.registry import KEY_PREFIX
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe

# Each test starts a cluster of 5-7 model processes: on a loaded 2-core machine that alone can
# take many minutes (a worker loading for 5 min was seen at load 80), so these get more than
# the suite's 600 s (a deadline, not a timed assertion).
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 16
# What the killed worker held in the pool (a manifest it was loading, a release its step loop had
# not sent yet) lapses by the lease deadline its KV connector asked for (docs/design.md §5):
# short here, so the idle check waits seconds, not a minute (the default is 60 s; as test_failover).
LEASE_TTL_S = 10.0


def four_prompts() -> list[list[int]]:
    return [reference.chat_ids(p) for p in reference.PROMPTS[:4]]


def start_cluster(tmp_path: Path, prefill_tp: int, decode_tp: int, **overrides) -> LocalCluster:
    config = ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE, num_kv_blocks=256,
        max_model_len=1024, max_num_batched_tokens=512, log_dir=tmp_path / "logs",
        prefill_tp=prefill_tp, decode_tp=decode_tp, disaggregation="always", **overrides,
    )
    cluster = LocalCluster(config)
    try:
        cluster.start(timeout_s=900)
    except BaseException:
        cluster.stop()
        raise
    return cluster


async def generate(stub, ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], int]:
    """(tokens, cached prompt tokens) of one greedy gRPC stream."""
    tokens, cached = [], -1
    params = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens)
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling_params=params)
    async for msg in stub.Generate(request, timeout=300):
        if msg.HasField("delta"):
            tokens += msg.delta.token_ids
        else:
            cached = msg.finished.usage.cached_tokens
    return tokens, cached


async def generate_all(cluster: LocalCluster, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await asyncio.gather(*(generate(stub, ids) for ids in prompts))


def follow_ups() -> list[list[int]]:
    """Each shares its original's first two full blocks, then goes elsewhere."""
    prompts = four_prompts()
    return [ids[:2 * BLOCK_SIZE] + prompts[(i + 1) % 4][-10:] for i, ids in enumerate(prompts)]


@pytest.fixture(scope="module")
def references() -> None:
    """HF's answers, computed before any cluster takes the cores."""
    for ids in four_prompts() + follow_ups():
        reference.hf_greedy(ids, MAX_TOKENS)


@pytest.fixture(scope="module")
def two_tp2_decoders(references, tmp_path_factory):
    """Prefill TP=1 and two TP=2 decode workers: the P-tp1-D-tp2 equality proof, then the rank kill."""
    with start_cluster(tmp_path_factory.mktemp("tp-logs"), 1, 2, num_decode_workers=2,
                       kv_lease_ttl_s=LEASE_TTL_S) as cluster:
        yield cluster


@pytest.fixture
def mixed(request, references, tmp_path):
    """The cluster of (prefill_tp, decode_tp) = ``request.param``."""
    if request.param == (1, 2):
        yield request.getfixturevalue("two_tp2_decoders")
        return
    with start_cluster(tmp_path, *request.param) as cluster:
        yield cluster


@pytest.mark.parametrize("mixed", [(2, 1), (1, 2)], ids=["P-tp2-D-tp1", "P-tp1-D-tp2"], indirect=True)
def test_mixed_degrees_through_the_pool_equal_hf(mixed):
    """Four prompts at once, then prompts sharing their first two blocks: the decode worker (the
    other degree) reads every prompt's KV from the pool, the second round's prefixes too."""
    prompts, second = four_prompts(), follow_ups()
    probe = ClusterProbe(mixed)
    results = asyncio.run(generate_all(mixed, prompts))
    for ids, (tokens, _) in zip(prompts, results):
        assert tokens == reference.hf_greedy(ids, MAX_TOKENS)
    for ids, (tokens, cached) in zip(second, asyncio.run(generate_all(mixed, second))):
        assert tokens == reference.hf_greedy(ids, MAX_TOKENS)
        assert cached == 2 * BLOCK_SIZE  # exactly the shared blocks came from the pool
    poll_until(probe.is_idle, timeout_s=15, message="workers and pool back to idle")


def rank_pids(worker_pid: int) -> list[int]:
    """The tensor-parallel rank processes of a worker: its multiprocessing children that are not
    the resource tracker."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == worker_pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return pids


def test_killing_one_rank_of_a_tp2_decode_worker_migrates_its_streams(two_tp2_decoders):
    """Two TP=2 decode workers; rank 1 of one that is streaming is SIGKILLed. That worker
    deregisters and exits, its streams finish on the other one with HF's tokens, nothing leaks,
    and the supervisor restarts the killed worker as a whole (both ranks)."""
    prompts = four_prompts() * 3
    cluster = two_tp2_decoders
    probe = ClusterProbe(cluster)
    ranks = {name: rank_pids(cluster.service(name).process.pid) for name in ("decode", "decode-1")}
    assert [len(pids) for pids in ranks.values()] == [1, 1]

    async def run() -> tuple[str, list[tuple[list[int], int]]]:
        async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            tasks = [asyncio.create_task(generate(stub, ids)) for ids in prompts]
            victim = await streaming_worker(probe)
            os.kill(ranks[victim][0], signal.SIGKILL)
            return victim, await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

    victim_name, results = asyncio.run(run())
    survivor = "decode-1" if victim_name == "decode" else "decode"
    for ids, (tokens, _) in zip(prompts, results):
        assert tokens == reference.hf_greedy(ids, MAX_TOKENS)
    victim = cluster.service(victim_name)
    assert victim.process.wait(timeout=30) == 1
    log = victim.log_path.read_text()
    assert "deregistering and exiting" in log
    assert registered(cluster.redis_url, "decode") == 1  # the survivor; the victim took its key away
    assert probe.live_workers() == ["prefill", survivor]
    # The pool's lease deadline frees what the killed worker held (leases, and the tails of the
    # manifests it had taken over: they live by the writer's lease TTL); + 15 s (chaos's bound)
    poll_until(probe.is_idle, timeout_s=LEASE_TTL_S + 15, message="survivor and pool back to idle")

    def restarted() -> bool:
        cluster.supervise()
        return victim.process.poll() is None and victim.ready()

    poll_until(restarted, timeout_s=900, interval_s=0.5, message=f"{victim_name} restarted by the supervisor")
    assert len(rank_pids(victim.process.pid)) == 1  # a fresh rank 1 with the fresh worker
    poll_until(lambda: registered(cluster.redis_url, "decode") == 2, timeout_s=30,
               message=f"{victim_name} registered again")


async def streaming_worker(probe: ClusterProbe, timeout_s: float = 240.0) -> str:
    """The first decode worker seen running requests (GetStats polled off the event loop)."""

    def running() -> str | None:
        for name in ("decode", "decode-1"):
            if probe.worker_stats(name).num_requests_running > 0:
                return name
        return None

    deadline = asyncio.get_running_loop().time() + timeout_s
    while (name := await asyncio.to_thread(running)) is None:
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("no decode worker ever ran a request")
        await asyncio.sleep(0.05)  # polling a remote gauge, not synchronising with our own tasks
    return name


def registered(redis_url: str, role: str) -> int:
    client = redis.Redis.from_url(redis_url)
    return sum(1 for _ in client.scan_iter(match=f"{KEY_PREFIX}:{role}:*"))
