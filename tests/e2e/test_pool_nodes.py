"""Two KV pool nodes (blocks spread by consistent hashing); one is killed with -9 in the middle
of a run of 50 requests: every request still completes with the reference greedy output (what
lived on the dead node is recomputed), the survivor goes back to idle and the Redis index forgets
the dead node."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import redis

from core.grpc_service import insecure_channel
from kv_pool.index_mirror import INDEX_KEY_PREFIX, parse_index_value
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import common_pb2, kv_pool_pb2, kv_pool_pb2_grpc, router_pb2
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe
from tests.e2e.test_cluster import grpc_generate

pytestmark = pytest.mark.e2e
MAX_TOKENS = 6
NUM_REQUESTS = 50
KILL_AFTER = 12  # requests completed before the second node dies


def pool_stats(address: str):
    with insecure_channel(address) as channel:
        return kv_pool_pb2_grpc.KVPoolStub(channel).GetStats(kv_pool_pb2.GetPoolStatsRequest(), timeout=5)


def index_nodes(rdb: redis.Redis) -> set[str]:
    nodes = set()
    for key in rdb.scan_iter(match=f"{INDEX_KEY_PREFIX}*"):
        nodes |= {parse_index_value(v)[0] for v in rdb.hvals(key)}
    return nodes


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("two-pool-logs")
    config = ClusterConfig.from_options(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE,
        num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=256, pool_capacity_bytes=256 * 1024**2,
        log_dir=log_dir,
        pools_from_registry=True,  # workers find the pool nodes in Redis: the second one joins
        # Every prompt through the pool: with conditional disaggregation a decode worker that
        # calibrated faster than the prefill worker prefills short prompts itself, and a run in
        # a busy fresh-clone CI placed all 32 warm-up prompts colocated (no block reached pool-b).
        disaggregation="always",
    )
    with LocalCluster(config) as cluster:
        cluster.start()
        port = free_port()
        with open(log_dir / "kv_pool_b.log", "wb") as log:
            second = subprocess.Popen(
                [sys.executable, "-m", "kv_pool", "--port", str(port), "--redis-url", cluster.redis_url,
                 "--node-id", "pool-b", "--capacity-bytes", str(256 * 1024**2)],
                stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            address = f"127.0.0.1:{port}"
            poll_until(lambda: _answers(address), timeout_s=60, message="second pool node serving")
            yield cluster, second, address
        finally:
            if second.poll() is None:
                second.kill()
            second.wait()


def _answers(address: str) -> bool:
    try:
        pool_stats(address)
        return True
    except grpc.RpcError:
        return False


def generate(cluster, prompt: str) -> list[int]:
    tokens, _, _ = grpc_generate(
        cluster, chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )
    return tokens


def test_kill_one_of_two_pool_nodes_mid_run(two_node_cluster):
    cluster, second, second_address = two_node_cluster
    probe = ClusterProbe(cluster)
    prompts = [reference.PROMPTS[i % len(reference.PROMPTS)] for i in range(NUM_REQUESTS)]
    expected = {p: reference.hf_greedy(reference.chat_ids(p), MAX_TOKENS) for p in set(prompts)}
    # Which node a block lands on depends on the spec fingerprint (model file identity), so one
    # prompt's few blocks may all hash to one node: send distinct prompts until both hold some.
    warmup = iter(reference.PROMPTS * 4)
    poll_until(lambda: generate(cluster, next(warmup)) and pool_stats(second_address).num_stored_blocks > 0,
               timeout_s=60, message="workers spread blocks over both nodes")

    done, killed = threading.Semaphore(0), threading.Event()

    def one(prompt: str) -> list[int]:
        try:
            return generate(cluster, prompt)
        finally:
            done.release()

    def killer() -> None:
        for _ in range(KILL_AFTER):
            done.acquire()
        second.send_signal(signal.SIGKILL)
        killed.set()

    threading.Thread(target=killer, daemon=True).start()
    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(one, prompts))
    assert killed.is_set() and second.wait(timeout=10) == -signal.SIGKILL
    mismatches = [(p, got) for p, got in zip(prompts, results) if got != expected[p]]
    assert not mismatches, mismatches[:3]

    poll_until(probe.is_idle, timeout_s=15, message="survivor pool and workers back to idle")
    survivor = probe.pool_stats()
    assert survivor.num_stored_blocks > 0 and survivor.num_writing_blocks == 0
    rdb = redis.Redis.from_url(cluster.redis_url, decode_responses=True)
    poll_until(lambda: "pool-b" not in index_nodes(rdb), timeout_s=30, message="index forgot the dead node")
    assert index_nodes(rdb) == {"pool-0"}
