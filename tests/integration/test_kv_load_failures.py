"""A failed or slow KV load, end to end: the real prefill and decode servicers, their KV
connectors and the real model (SmolLM2, CPU, float32) against a real pool process whose gRPC
server injects faults (core.fault_injection). KV moves over gRPC with a 1 s lease TTL.

- a transfer slowed past the lease TTL still loads the right bytes: the lease is renewed
  (greedy answer equal to Hugging Face's, pool idle after);
- a lease lost mid-read is never used: recompute (HF-equal, counted once) or, under ``fail``,
  UNAVAILABLE with the reason in trailing metadata;
- the two bugs of the chaos campaign: a pool error during the prefill's prefix load recomputes
  (it escaped as UNKNOWN), a truncated GetBlocks recomputes (it was INVALID_ARGUMENT).
"""

from __future__ import annotations

import asyncio
import os
import uuid

import grpc
import pytest
from prometheus_client import CollectorRegistry

from core.fault_injection import ENV_VAR, FaultRule, write_rules
from core.pool_client import PoolClient
from core.proto_convert import sampling_params_to_proto
from core.sampling_params import SamplingParams
from decode_worker.servicer import DecodeServicer
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_connector import KVConnector, KVLoadFailurePolicy, KVLoadFailures, PoolIO, PoolLocator
from engine.kv_connector.load_failure import METADATA_KEY, make_counter
from prefill_worker.servicer import PrefillServicer
from tandem.v1 import decode_worker_pb2, prefill_worker_pb2
from tests import reference
from tests.integration.test_kv_pool_server import start_pool  # noqa: F401

BLOCK_SIZE = 16
MAX_TOKENS = 8
LEASE_TTL_S = 1.0
SLOW_S = 2.5  # a GetBlocks delayed this long outlives the 1 s lease more than twice


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("faults") / "faults.json")
    write_rules(path, [])
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = path  # the pool process inherits it (this process never reads it again)
    yield path
    if old is None:
        del os.environ[ENV_VAR]
    else:
        os.environ[ENV_VAR] = old


@pytest.fixture(scope="module")
def pool(fault_file, start_pool):
    # The pool's own default TTL (scoped blocks' lifetime) as short as the workers' leases.
    return start_pool(64 << 20, "--lease-ttl-s", str(LEASE_TTL_S))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    # No local prefix cache: num_cached_tokens then counts only tokens loaded from the pool.
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=256,
                          enable_prefix_caching=False)
    return LLMEngine.from_config(config, save_kv_on_finish=True)


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self):
        self.code = self.details = None
        self.trailing_metadata = ()

    async def abort(self, code, details, trailing_metadata=()):
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing_metadata)
        raise Aborted(details)

    def add_done_callback(self, callback) -> None:
        pass


class Worker:
    def __init__(self, role: str, engine: AsyncEngine, pool_address: str, policy: KVLoadFailurePolicy):
        self.counter = make_counter(CollectorRegistry())
        io = PoolIO(engine.spec, lease_ttl_s=LEASE_TTL_S, transfer="grpc", verify_checksums=True)
        self.connector = KVConnector(engine.spec, PoolLocator(None, pool_address, "grpc"), io,
                                     KVLoadFailures(policy, self.counter))
        self.servicer = (PrefillServicer if role == "prefill" else DecodeServicer)(engine, self.connector)

    def failures(self) -> dict[tuple[str, str, str], float]:
        return {tuple(s.labels[k] for k in ("stage", "reason", "action")): s.value
                for m in self.counter.collect() for s in m.samples if s.name.endswith("_total")}


def prompt_ids(whole_blocks: bool = False) -> list[int]:
    """A real chat prompt (36 tokens: 2 full blocks and a tail), or its 2 full blocks only."""
    ids = reference.chat_ids(reference.PROMPTS[2])
    return ids[: len(ids) // BLOCK_SIZE * BLOCK_SIZE] if whole_blocks else ids


async def serve(engine: LLMEngine, pool_address: str, fault_file: str, prompt: list[int], rules_before_decode,
                policy=KVLoadFailurePolicy.RECOMPUTE, rules_before_prefill=()):
    """One request through Prefill then Decode; returns (tokens, prefill response, decode context,
    prefill worker, decode worker). The fault rules apply from before the named call on."""
    async_engine = AsyncEngine(engine)
    async_engine.start()
    prefill = Worker("prefill", async_engine, pool_address, policy)
    decode = Worker("decode", async_engine, pool_address, policy)
    rid = f"req-{uuid.uuid4().hex[:8]}"
    params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    try:
        write_rules(fault_file, list(rules_before_prefill))
        response = await prefill.servicer.Prefill(
            prefill_worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params),
            FakeContext())
        write_rules(fault_file, list(rules_before_decode))
        message = decode_worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params,
                                                  first_token_id=response.first_token_id)
        message.manifest.CopyFrom(response.manifest)
        context, tokens = FakeContext(), [response.first_token_id]
        try:
            async for out in decode.servicer.Decode(message, context):
                if out.WhichOneof("event") == "tokens":
                    tokens += list(out.tokens.token_ids)
        except Aborted:
            pass
        return tokens, response, context, prefill, decode
    finally:
        write_rules(fault_file, [])
        prefill.connector.close()  # runs deferred releases first
        decode.connector.close()
        async_engine.stop()


def warm_prefix(engine, pool, fault_file, prompt):
    """Stores the prompt's full blocks in the pool (a first request), so the next has a prefix hit."""
    tokens, *_ = asyncio.run(serve(engine, pool.address, fault_file, prompt, []))
    assert tokens == reference.hf_greedy(prompt, MAX_TOKENS)
    tokens, response, *_ = asyncio.run(serve(engine, pool.address, fault_file, prompt, []))
    assert response.num_cached_tokens == len(prompt) // BLOCK_SIZE * BLOCK_SIZE  # a hit, without faults


def assert_idle(pool) -> None:
    """No lease, no leased, scoped or writing block (the pool's expiry runs every 0.5 s)."""
    with PoolClient(pool.address, timeout_s=10) as client:
        s = client.stats()
    assert (s["num_leases"], s["num_leased_blocks"], s["num_scoped_blocks"], s["num_writing_blocks"]) == (0, 0, 0, 0)


def test_a_transfer_slower_than_the_lease_is_renewed_and_correct(engine, pool, fault_file):
    prompt = prompt_ids()
    assert len(prompt) % BLOCK_SIZE  # a scoped tail block: freed with the request if its lease lapsed
    slow = [FaultRule("delay", ("GetBlocks",), delay_s=SLOW_S)]
    tokens, _, context, _, decode = asyncio.run(serve(engine, pool.address, fault_file, prompt, slow))
    assert context.code is None
    assert tokens == reference.hf_greedy(prompt, MAX_TOKENS)
    assert decode.failures() == {}  # every block came from the pool, none recomputed
    assert decode.connector.io.leases.num_renewals >= 2  # ~every ttl/3 of the 2.5 s read
    assert decode.connector.io.leases.num_lost == 0
    assert_idle(pool)


# The lease is lost: GetBlocks outlives it while every RenewLease fails. A prompt of whole blocks
# only (no scoped tail that would vanish with the lease), so GetBlocks itself succeeds and only
# the lease proof can tell the read outlived its lease.
LOST = [FaultRule("delay", ("GetBlocks",), delay_s=SLOW_S), FaultRule("error", ("RenewLease",))]


def test_a_lease_lost_mid_read_is_recomputed_and_counted(engine, pool, fault_file):
    prompt = prompt_ids(whole_blocks=True)
    tokens, _, context, _, decode = asyncio.run(serve(engine, pool.address, fault_file, prompt, LOST))
    assert context.code is None
    assert tokens == reference.hf_greedy(prompt, MAX_TOKENS)
    assert decode.failures() == {("manifest", "lease_lost", "recompute"): 1.0}
    assert_idle(pool)


def test_a_lease_lost_mid_read_under_fail_ends_unavailable(engine, pool, fault_file):
    prompt = prompt_ids(whole_blocks=True)
    tokens, response, context, _, decode = asyncio.run(
        serve(engine, pool.address, fault_file, prompt, LOST, KVLoadFailurePolicy.FAIL))
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.details.startswith("KV load failed (lease_lost): ")
    assert context.trailing_metadata == ((METADATA_KEY, "lease_lost"),)
    assert tokens == [response.first_token_id]  # nothing decoded from the suspect bytes
    assert decode.failures() == {("manifest", "lease_lost", "fail"): 1.0}
    assert_idle(pool)


def test_a_pool_error_during_the_prefix_load_recomputes(engine, pool, fault_file):
    """Bug: the prefill worker let the pool's UNAVAILABLE escape as UNKNOWN (HTTP 503)."""
    prompt = prompt_ids()
    warm_prefix(engine, pool, fault_file, prompt)
    failing = [FaultRule("error", ("GetBlocks",), code="UNAVAILABLE")]
    tokens, response, context, prefill, _ = asyncio.run(
        serve(engine, pool.address, fault_file, prompt, [], rules_before_prefill=failing))
    assert response.num_cached_tokens == 0  # the prefix hit was ignored: the whole prompt prefilled
    assert tokens == reference.hf_greedy(prompt, MAX_TOKENS) and context.code is None
    assert prefill.failures() == {("prefix", "unreachable", "recompute"): 1.0}
    assert_idle(pool)


def test_a_pool_error_during_the_prefix_load_under_fail_is_unavailable(engine, pool, fault_file):
    prompt = prompt_ids()
    warm_prefix(engine, pool, fault_file, prompt)
    async def run():
        async_engine = AsyncEngine(engine)
        async_engine.start()
        prefill = Worker("prefill", async_engine, pool.address, KVLoadFailurePolicy.FAIL)
        params = sampling_params_to_proto(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
        context = FakeContext()
        try:
            write_rules(fault_file, [FaultRule("error", ("GetBlocks",), code="UNAVAILABLE")])
            with pytest.raises(Aborted):
                await prefill.servicer.Prefill(prefill_worker_pb2.PrefillRequest(
                    request_id="fail-prefix", prompt_token_ids=prompt, sampling_params=params), context)
        finally:
            write_rules(fault_file, [])
            prefill.connector.close()
            async_engine.stop()
        return context, prefill
    context, prefill = asyncio.run(run())
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.trailing_metadata == ((METADATA_KEY, "unreachable"),)
    assert prefill.failures() == {("prefix", "unreachable", "fail"): 1.0}
    assert_idle(pool)


def test_a_truncated_transfer_recomputes_instead_of_invalid_argument(engine, pool, fault_file):
    """Bug: a GetBlocks stream cut short was reported as INVALID_ARGUMENT (HTTP 400)."""
    prompt = prompt_ids()
    warm_prefix(engine, pool, fault_file, prompt)
    cut = [FaultRule("truncate", ("GetBlocks",))]
    tokens, response, context, prefill, decode = asyncio.run(
        serve(engine, pool.address, fault_file, prompt, cut, rules_before_prefill=cut))
    assert context.code is None and response.num_cached_tokens == 0
    assert tokens == reference.hf_greedy(prompt, MAX_TOKENS)
    assert prefill.failures() == {("prefix", "truncated", "recompute"): 1.0}
    assert decode.failures() == {("manifest", "truncated", "recompute"): 1.0}
    assert_idle(pool)
