"""KV transfer backends carrying real requests, and a corrupted pool block recomputed.

Two clusters of their own, both disaggregated for every request (``--disaggregation always``:
the router would otherwise prefill these short prompts on the decode worker and skip the pool):
one on shared memory for both workers (the decode worker copies the prompt's KV from the mapped
arena straight into its KV cache), one with a NIXL agent in the pool, the prefill worker on NIXL
(writes, and reads of cached prefixes) and the decode worker on gRPC (reads). Backends are chosen
through the workers' environment (``TANDEM_<ROLE>_KV_TRANSFER``).
"""

from __future__ import annotations

import contextlib
import mmap
import os

import pytest

from launcher.config import ClusterConfig

from launcher.local_cluster import LocalCluster

from launcher.ports import free_port
from tandem.v1 import common_pb2, kv_pool_pb2, router_pb2
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe
from tests.e2e.test_cluster import grpc_generate

pytestmark = pytest.mark.e2e
MAX_TOKENS = 8
PROMPT = "Write a short poem about the ocean and the moon, please."  # > 2 blocks with the template


def generate(cluster, prompt: str = PROMPT):
    return grpc_generate(
        cluster, chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )


def full_cached_tokens(prompt: str = PROMPT) -> int:
    n = len(reference.chat_ids(prompt))
    return min(n // BLOCK_SIZE * BLOCK_SIZE, n - 1)


@contextlib.contextmanager
def transfer_cluster(log_dir, env: dict[str, str]):
    """A disaggregated cluster whose services see ``env`` (restored once they are started)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # inherited by the services LocalCluster spawns
    config = ClusterConfig.from_options(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE,
        num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=256, pool_capacity_bytes=256 * 1024**2,
        log_dir=log_dir, disaggregation="always",
    )
    try:
        with LocalCluster(config) as c:
            c.start()
            for key, value in saved.items():
                os.environ.pop(key) if value is None else os.environ.__setitem__(key, value)
            yield c
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def assert_backends(cluster, prefill: str, decode: str) -> None:
    for name, mode in (("prefill", prefill), ("decode", decode)):
        log = (cluster.config.log_dir / f"{name}.log").read_text()
        assert f"kv transfer to pool {cluster.addresses['kv_pool']}: {mode}" in log


@pytest.fixture(scope="module")
def shm_cluster(tmp_path_factory):
    env = {"TANDEM_PREFILL_KV_TRANSFER": "shm", "TANDEM_DECODE_KV_TRANSFER": "shm"}
    with transfer_cluster(tmp_path_factory.mktemp("shm-cluster-logs"), env) as c:
        yield c


def test_shared_memory_carries_requests_and_a_corrupt_block_is_recomputed(shm_cluster):
    cluster, probe = shm_cluster, ClusterProbe(shm_cluster)
    expected = reference.hf_greedy(reference.chat_ids(PROMPT), MAX_TOKENS)
    tokens, _, _ = generate(cluster)
    assert tokens == expected

    plane = probe.pool.GetDataPlane(kv_pool_pb2.GetDataPlaneRequest(), timeout=5)
    assert plane.arena_path.startswith("/dev/shm/")
    block_bytes = 737_280  # SmolLM2-135M, fp32, block_size 16: every arena slot is one block
    with open(plane.arena_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as arena:
        for offset in range(0, plane.arena_bytes - block_bytes + 1, block_bytes):
            arena[offset + 4] ^= 0xFF  # flip a bit in every slot: every stored block is now bad
    corrupt_before = probe.pool_stats().num_corrupt_blocks

    # The prefill worker's pool read fails the checksum on the first block: the pool drops it and
    # the worker computes the prompt (or reuses its own local prefix cache), never the bad bytes.
    tokens, _, _ = generate(cluster)
    assert tokens == expected
    assert probe.pool_stats().num_corrupt_blocks > corrupt_before

    tokens, _, finished = generate(cluster)  # the recompute stored good blocks again
    assert tokens == expected and finished.usage.cached_tokens == full_cached_tokens()
    assert_backends(cluster, "shm", "shm")
    poll_until(probe.is_idle, timeout_s=5, message="shm cluster back to idle")


@pytest.fixture(scope="module")
def nixl_cluster(tmp_path_factory):
    env = {"TANDEM_POOL_NIXL": "on", "TANDEM_PREFILL_KV_TRANSFER": "nixl", "TANDEM_DECODE_KV_TRANSFER": "grpc"}
    with transfer_cluster(tmp_path_factory.mktemp("nixl-cluster-logs"), env) as c:
        yield c


def test_nixl_writes_and_reads_and_grpc_reads_carry_requests(nixl_cluster):
    probe = ClusterProbe(nixl_cluster)
    plane = probe.pool.GetDataPlane(kv_pool_pb2.GetDataPlaneRequest(), timeout=5)
    assert plane.nixl_agent_metadata and plane.nixl_arena_address
    expected = reference.hf_greedy(reference.chat_ids(PROMPT), MAX_TOKENS)
    for round_ in range(2):  # the second prefill reads its cached prefix through NIXL
        tokens, _, finished = generate(nixl_cluster)
        assert tokens == expected
        assert finished.usage.cached_tokens == (full_cached_tokens() if round_ else 0)
    assert_backends(nixl_cluster, "nixl", "grpc")
    poll_until(probe.is_idle, timeout_s=5, message="nixl cluster back to idle")
