"""8-bit KV blocks (``--kv-cache-dtype fp8``) through a real cluster, and workers of different KV
dtypes refused rather than read wrong.

- An fp8 cluster (prefill -> pool -> decode, every request disaggregated) gives exactly the greedy
  tokens of a colocated fp8 engine on the same prompts, the pool holds blocks of the fp8 spec's
  size (values and scales: 195,840 bytes for SmolLM2-135M at 16 tokens, a quarter of float32's
  plus the scales), a repeated prompt is served from its cached fp8 prefix, and everything is
  back to idle afterwards.
- A cluster whose prefill worker writes fp8 blocks and whose decode worker keeps float32 KV:
  the decode worker refuses the manifest (INVALID_ARGUMENT naming both KV dtypes), which reaches
  the client, and the refused request's pool blocks are released.
"""

from __future__ import annotations

import contextlib
import os

import grpc
import pytest

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import common_pb2, router_pb2
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe
from tests.e2e.test_cluster import grpc_generate
from tests.factories import run_all

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12
PROMPTS = reference.PROMPTS[:3]
FP8_BLOCK_BYTES = 30 * 2 * BLOCK_SIZE * 3 * (64 + 4)  # layers x K/V x tokens x KV heads x (values + scale)
CLUSTER = dict(model="SmolLM2-135M-Instruct", block_size=BLOCK_SIZE, num_kv_blocks=128, max_model_len=512,
               max_num_batched_tokens=256, pool_capacity_bytes=128 * 1024**2, disaggregation="always")


def generate(cluster, prompt: str):
    return grpc_generate(
        cluster, chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=prompt)]),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
    )


@contextlib.contextmanager
def kv_cluster(log_dir, env: dict[str, str] | None = None, **options):
    """A disaggregated cluster; ``env`` is seen by the services it starts (restored after)."""
    env = env or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    config = ClusterConfig.from_options(http_port=free_port(), grpc_port=free_port(), log_dir=log_dir,
                                        **CLUSTER, **options)
    try:
        with LocalCluster(config) as c:
            c.start()
            yield c
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def colocated_fp8_tokens() -> list[list[int]]:
    """Each prompt alone through one fp8 engine in this process (prefill and decode on its own
    cache): the colocated run the cluster must equal."""
    config = EngineConfig(model=CLUSTER["model"], kv_cache_dtype="fp8", block_size=BLOCK_SIZE, num_kv_blocks=128,
                          max_model_len=512, max_num_batched_tokens=256, num_threads=1)
    engine = LLMEngine.from_config(config)
    try:
        tokens = []
        for i, prompt in enumerate(PROMPTS):
            request = Request(f"r{i}", reference.chat_ids(prompt), SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
            tokens.append(run_all(engine, [request])[f"r{i}"])
        return tokens
    finally:
        engine.shutdown()


def test_fp8_blocks_through_the_pool_give_the_colocated_fp8_tokens(tmp_path):
    expected = colocated_fp8_tokens()
    with kv_cluster(tmp_path / "logs", kv_cache_dtype="fp8") as cluster:
        probe = ClusterProbe(cluster)
        for prompt, want in zip(PROMPTS, expected):  # the later prompts hit the first's system-prompt block
            tokens, _, _ = generate(cluster, prompt)
            assert tokens == want
        pool = probe.pool_stats()
        assert pool.num_stored_blocks > 0 and pool.used_bytes == pool.num_stored_blocks * FP8_BLOCK_BYTES

        # The same prompt again: its full blocks come back from the pool as a prefix hit.
        n = len(reference.chat_ids(PROMPTS[0]))
        tokens, _, finished = generate(cluster, PROMPTS[0])
        assert tokens == expected[0]
        assert finished.usage.cached_tokens == min(n // BLOCK_SIZE * BLOCK_SIZE, n - 1)
        poll_until(probe.is_idle, timeout_s=10, message="fp8 cluster back to idle")


def test_a_decode_worker_refuses_blocks_of_another_kv_dtype(tmp_path):
    env = {"TANDEM_PREFILL_KV_CACHE_DTYPE": "fp8"}  # the decode worker keeps the cluster's auto (float32)
    with kv_cluster(tmp_path / "logs", env) as cluster:
        probe = ClusterProbe(cluster)
        with pytest.raises(grpc.RpcError) as refused:
            generate(cluster, PROMPTS[0])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == ("manifest KV blocks are fp8, this worker's KV cache is float32: prefill "
                                           "and decode workers need the same --kv-cache-dtype (and --dtype)")
        poll_until(probe.is_idle, timeout_s=10, message="mixed cluster back to idle")
        pool = probe.pool_stats()
        assert (pool.num_leases, pool.num_scoped_blocks) == (0, 0)
