"""Tensor-parallel engines (TP=2 on the CPU over gloo: rank 0 here, rank 1 a spawned process)
against the Hugging Face reference, token for token, and KV crossing TP degrees: saved by one
degree, loaded by the other, directly and through a real pool as a prefix-cache hit."""

from __future__ import annotations

import asyncio

import pytest

from core.pool_client import PoolClient
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import ExternalKV
from engine.kv_connector import PoolIO
from engine.model.linear import Linear
from tests import reference
from tests.integration.test_kv_pool_server import SMOLLM_BLOCK_BYTES, start_pool  # noqa: F401
from tests.factories import run_all

MAX_TOKENS = 16
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def make_engine():
    """``make(tp, **overrides)``: the engine of that configuration, kept for the next test. A
    process holds one tensor-parallel engine at a time (one torch.distributed default group), so
    asking for another TP configuration shuts the previous one down (the tests are ordered so
    that each TP=2 configuration starts once). Every engine is shut down at the end."""
    engines: dict[tuple, LLMEngine] = {}

    def make(tp: int, **overrides) -> LLMEngine:
        key = (tp, *sorted(overrides.items()))
        if key not in engines:
            if tp > 1:
                for other in [k for k in engines if k[0] > 1]:
                    engines.pop(other).shutdown()
            config = dict(block_size=BLOCK_SIZE, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=512,
                          num_threads=1, tensor_parallel_size=tp)
            engines[key] = LLMEngine.from_config(EngineConfig(**{**config, **overrides}), save_kv_on_finish=True)
        return engines[key]

    yield make
    for engine in engines.values():
        engine.shutdown()


def greedy(request_id: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Request:
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens))


def test_tp2_shards_kv_heads_and_keeps_the_pool_spec(make_engine):
    tp1, tp2 = make_engine(1), make_engine(2)
    # SmolLM2-135M: 3 KV heads, 9 query heads; rank 0 of 2 owns KV heads 0-1 (query heads 0-5).
    assert tp1.runner.kv_cache.shape[4] == 3 and tp2.runner.kv_cache.shape[4] == 2
    assert tp2.runner.model.model.layers[0].self_attn.num_heads == 6
    assert tp2.spec == tp1.spec and tp2.spec.fingerprint == tp1.spec.fingerprint
    assert tp2.parallel.processes.all_alive and tp1.parallel is None


def test_tp2_batched_greedy_equals_hf(make_engine):
    assert_batch_equals_hf(make_engine(2))


def assert_batch_equals_hf(engine: LLMEngine) -> None:
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    got = run_all(engine, [greedy(f"r{i}", p) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference.hf_greedy(p, MAX_TOKENS), reference.PROMPTS[i]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_kv_saved_by_one_degree_decodes_on_the_other(make_engine, prefill_tp, decode_tp):
    prefill, decode = make_engine(prefill_tp), make_engine(decode_tp)
    prompt = reference.chat_ids(reference.PROMPTS[2])
    out = []
    prefill.add_request(greedy("a", prompt, 1))
    while prefill.has_unfinished_requests():
        out += prefill.step()
    saved = out[-1].saved_kv
    assert len(saved) == -(-len(prompt) // BLOCK_SIZE) and {len(b) for b in saved} == {prefill.spec.block_bytes}
    follow = greedy("b", prompt)
    follow.append_output_token(out[-1].new_token_ids[0])
    got = run_all(decode, [follow], {"b": ExternalKV(len(prompt), saved)})
    assert follow.output_token_ids == reference.hf_greedy(prompt, MAX_TOKENS)
    assert got["b"] == follow.output_token_ids[1:]


@pytest.fixture(scope="module")
def pool(start_pool):
    return start_pool(64 * SMOLLM_BLOCK_BYTES)


@pytest.mark.parametrize(("writer_tp", "reader_tp"), [(2, 1), (1, 2)])
def test_prefix_hit_through_the_pool_across_degrees(make_engine, pool, writer_tp, reader_tp):
    """The writer prefills prompt A and stores its blocks; the reader's prompt B shares A's first
    two blocks, finds exactly those in the pool (shared memory, leased), and answers as HF does."""
    writer, reader = make_engine(writer_tp), make_engine(reader_tp)
    a = reference.chat_ids(reference.PROMPTS[1])
    b = a[:2 * BLOCK_SIZE] + reference.chat_ids(reference.PROMPTS[3])[:20]
    assert len(a) >= 2 * BLOCK_SIZE + 1
    io = PoolIO(writer.spec, lease_ttl_s=30, transfer="shm")
    out = run_and_collect(writer, greedy(f"w{writer_tp}", a, 1))
    _, keys = io.prompt_keys(f"w{writer_tp}", a)
    asyncio.run(io.store(pool.address, f"w{writer_tp}", keys, out.saved_kv, skip=0))
    asyncio.run(io.release(pool.address, f"w{writer_tp}"))

    rid = f"r{reader_tp}"
    hashes, _ = io.prompt_keys(rid, b)
    cached = asyncio.run(io.load_cached_prefix(pool.address, rid, hashes))
    assert len(cached) == 2
    got = run_all(reader, [greedy(rid, b)], {rid: ExternalKV(2 * BLOCK_SIZE, cached)})
    del cached  # the shm views: their lease goes once copied (and these references dropped)
    assert got[rid] == reference.hf_greedy(b, MAX_TOKENS)
    asyncio.run(io.release(pool.address, rid))
    io.close()
    with PoolClient(pool.address, timeout_s=30) as client:
        stats = client.stats()
        assert [stats[k] for k in ("num_writing_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases")] \
            == [0, 0, 0, 0], stats


def run_and_collect(engine: LLMEngine, request: Request):
    engine.add_request(request)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs[-1]


def test_tp2_chunked_prefill_equals_hf(make_engine):
    assert_batch_equals_hf(make_engine(2, max_num_batched_tokens=24))


def test_tp2_preemption_swaps_whole_blocks_and_keeps_output(make_engine):
    # 12 blocks of 16 tokens cannot hold 8 prompts of ~30 tokens plus their outputs at once: the
    # swapped-out KV is gathered from both ranks and scattered back on resume.
    engine = make_engine(2, num_kv_blocks=12, max_model_len=128, max_num_batched_tokens=128)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    got = run_all(engine, [greedy(f"p{i}", p) for i, p in enumerate(prompts)])
    assert engine.stats().num_preemptions > 0 and engine.num_swapped_out > 0
    for i, p in enumerate(prompts):
        assert got[f"p{i}"] == reference.hf_greedy(p, MAX_TOKENS)


def test_unshardable_degree_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 exceeds num_kv_heads 3"):
        LLMEngine.from_config(EngineConfig(num_kv_blocks=64, max_model_len=512, tensor_parallel_size=4))


def test_shutdown_stops_every_rank(make_engine):
    engine = make_engine(2, num_kv_blocks=64)
    processes = engine.parallel.processes.processes
    assert [p.is_alive() for p in processes] == [True]
    engine.shutdown()
    assert [p.exitcode for p in processes] == [0]
    engine.shutdown()  # idempotent (the fixture calls it once more)


def test_fp8_kv_crosses_degrees_with_its_scales(make_engine):
    """fp8 blocks (head rows of 64 values and a float32 scale) saved at one degree decode at the
    other: each TP=2 rank holds its heads' rows with their scales, rank 0 joins and cuts whole
    blocks. The reference is TP=1 fp8 alone (8-bit KV is not float32's tokens), 12 tokens."""
    tp1, tp2 = make_engine(1, kv_cache_dtype="fp8"), make_engine(2, kv_cache_dtype="fp8")
    assert tp2.spec == tp1.spec and tp1.spec.kv_dtype_name == "fp8"
    assert tuple(tp1.runner.kv_cache.shape[-2:]) == (3, 68) and tuple(tp2.runner.kv_cache.shape[-2:]) == (2, 68)
    prompt = reference.chat_ids(reference.PROMPTS[2])
    expected = run_all(tp1, [greedy("alone", prompt, 12)])["alone"]
    for prefill, decode in ((tp2, tp1), (tp1, tp2)):
        out = []
        prefill.add_request(greedy("a", prompt, 1))
        while prefill.has_unfinished_requests():
            out += prefill.step()
        saved = out[-1].saved_kv
        assert {len(b) for b in saved} == {tp1.spec.block_bytes} == {30 * 2 * BLOCK_SIZE * 3 * 68}
        follow = greedy("b", prompt, 12)
        follow.append_output_token(out[-1].new_token_ids[0])
        run_all(decode, [follow], {"b": ExternalKV(len(prompt), saved)})
        assert follow.output_token_ids == expected


def test_tp2_int8_quantises_each_ranks_slice(make_engine):
    """--quantization int8 at TP=2: each rank quantises its own slice of every linear layer (per
    output channel, so a column-parallel slice keeps TP=1's scales), and its O and gate/up round
    their input rows to 8 bits on the rank's slice (a row-parallel O sees half of each row, so
    its scales, and some tokens, differ from TP=1's). Measured: the first token equals HF float32's
    for 8 of 8 prompts, all 16 for 5 of 8 (TP=1 int8: 3 of 8)."""
    engine = make_engine(2, quantization="int8")
    linears = [m for m in engine.runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 30 * 4 + 1 and all(m.qweight is not None for m in linears)
    assert sum(m.activation_bits == 8 for m in linears) == 30 * 2
    o_proj = engine.runner.model.model.layers[0].self_attn.o_proj
    assert tuple(o_proj.qweight.shape) == (576, 6 * 64)  # rank 0: its 6 of 9 query heads' columns
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    got = run_all(engine, [greedy(f"q{i}", p) for i, p in enumerate(prompts)])
    hf = [reference.hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert sum(got[f"q{i}"][:1] == hf[i][:1] for i in range(len(prompts))) >= 7
    assert engine.stats().num_used_blocks == 0
