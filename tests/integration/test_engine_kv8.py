"""8-bit KV (``--kv-cache-dtype fp8|int8``) on the real model, in one process: what moves KV
between places keeps an 8-bit request's tokens unchanged.

The reference is the same 8-bit engine with room for every request and whole prompts: chunked
prefill (a chunk attends over the dequantised rows of the ones before), swap preemption (blocks
out to host memory and back, scales with them) and KV saved by one engine and loaded by another
(the disaggregated path's bytes) give its greedy tokens. Float32's tokens are not the reference:
8-bit K/V move logits by their rounding and flip some near-ties (the perplexity cost is in
docs/quantization.md).

Near-ties: with fp8 or int8 KV some of the eight prompts reach steps whose top two logits are
so close that float32 rounding alone decides them (measured, 20 tokens, fp8: prompt 1 at token
17 and prompt 2 at token 15 change with the attention backend, cpu against torch, or with the
batch's composition, no KV moved at all; a run with 16 blocks and 24-token chunks flipped prompt
7 within 12 tokens; the CPU flash-attention kernel of prompt chunks, another summation order,
flipped two of eight). A chunked or swapped request sees other batches and chunk shapes, so the
batched test lets a prompt leave the reference only at a near-tie: where the two first differ,
the reference ranked the token the other run took within NEAR_TIE of its first. A lost
or misplaced scale corrupts every swapped request from its next token, far from any tie.
The single request moved between engines has no batch to differ in: its tokens must be equal.
"""

from __future__ import annotations

import pytest

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import ExternalKV
from tests import reference
from tests.factories import run_all

MAX_TOKENS = 12
# How far below the reference's best another run's token may rank where the two first differ:
# float32 rounding differences of the K/V rows before they are quantised (GEMMs of another chunk shape)
# move an 8-bit value by a whole step now and then; the largest gap seen flipped is 0.115 (fp8,
# prompt 7, its second token, prompt chunks through the CPU flash-attention kernel).
NEAR_TIE = 0.25


@pytest.fixture(scope="module", params=["fp8", "int8"])
def engines(request):
    """(roomy, tight) engines of one KV dtype: the tight one has 16 blocks of 16 tokens for eight
    prompts of ~30 tokens plus 12 outputs each (it must preempt) and a 24-token step budget
    (every prompt chunked)."""
    # One GEMM backend at every M: the linear chooser may give a 24-token chunk and a 240-token
    # step different kernels (another summation order), and on a plan that did, prompt 0's first
    # token flipped at a top-2 gap of 0.36 with no KV moved wrongly (fp8, Zen 4).
    base = dict(block_size=16, max_model_len=256, kv_cache_dtype=request.param, preemption_mode="swap",
                linear_backend="onednn")
    roomy = LLMEngine.from_config(EngineConfig(**base, num_kv_blocks=256, max_num_batched_tokens=512),
                                  save_kv_on_finish=True)
    tight = LLMEngine.from_config(EngineConfig(**base, num_kv_blocks=16, max_num_batched_tokens=24))
    yield request.param, roomy, tight
    roomy.shutdown()
    tight.shutdown()


def requests(prefix: str, logprobs: int | None = None) -> list[Request]:
    return [Request(f"{prefix}{i}", reference.chat_ids(p),
                    SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=logprobs))
            for i, p in enumerate(reference.PROMPTS)]


def run_with_top(engine, batch) -> dict[str, list[tuple[tuple[int, float], ...]]]:
    """Steps ``batch`` (requests asking for logprobs) to the end; each request's top
    (token id, logprob) pairs per output token, best first."""
    top = {r.request_id: [] for r in batch}
    for r in batch:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            top[o.request_id] += [t.top_logprobs for t in o.logprobs]
    assert engine.stats().num_used_blocks == 0
    return top


def test_chunked_prefill_and_swap_preemption_keep_the_8bit_tokens(engines):
    kv_dtype, roomy, tight = engines
    assert roomy.spec.kv_dtype_name == kv_dtype and roomy.runner.kv_cache.shape[-1] == 64 + 4
    top = run_with_top(roomy, requests("a", logprobs=5))
    expected = {rid: [pairs[0][0] for pairs in steps] for rid, steps in top.items()}
    before = tight.stats().num_preemptions
    got = run_all(tight, requests("a"))
    assert tight.stats().num_preemptions > before and tight.num_swapped_out > 0
    # A prompt may leave the reference only at a near-tie: at the first differing token the tight
    # run must have taken a token the reference ranked within NEAR_TIE of its best (near-ties of
    # three happen: prompt 1's second token had three within 0.07). The two runs' rows differ only
    # where float32 rounding of another chunk shape pushed a value across an 8-bit rounding
    # boundary; a lost or misplaced scale moves logits by whole units and fails this from the next
    # token of a swapped or chunked request.
    for rid, tokens in expected.items():
        if got[rid] == tokens:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got[rid], tokens)) if a != b)
        ranked = dict(top[rid][i])
        assert got[rid][i] in ranked and top[rid][i][0][1] - ranked[got[rid][i]] < NEAR_TIE, \
            (rid, i, got[rid], tokens, top[rid][i])
    assert sum(got[rid] == expected[rid] for rid in expected) >= len(expected) // 2


def test_8bit_kv_saved_by_one_engine_decodes_on_another(engines):
    _, roomy, tight = engines
    prompt = reference.chat_ids(reference.PROMPTS[2])
    expected = run_all(roomy, [Request("whole", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))])["whole"]
    out = []
    roomy.add_request(Request("p", prompt, SamplingParams(temperature=0, max_tokens=1)))
    while roomy.has_unfinished_requests():
        out += roomy.step()
    saved = out[-1].saved_kv
    assert [len(b) for b in saved] == [roomy.spec.block_bytes] * -(-len(prompt) // 16)
    follow = Request("d", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    follow.append_output_token(out[-1].new_token_ids[0])
    run_all(tight, [follow], {"d": ExternalKV(len(prompt), saved)})
    assert follow.output_token_ids == expected
