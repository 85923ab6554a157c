"""The engine alone (no services) against the Hugging Face reference, token for token."""

from __future__ import annotations

import pytest

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import ExternalKV
from tests import reference
from tests.factories import run_all

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def make_engine():
    engines = {}

    def make(**overrides) -> LLMEngine:
        key = tuple(sorted(overrides.items()))
        if key not in engines:
            config = dict(block_size=16, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=512)
            engines[key] = LLMEngine.from_config(EngineConfig(**{**config, **overrides}), save_kv_on_finish=True)
        return engines[key]

    return make


@pytest.mark.parametrize("budget", [512, 24], ids=["whole-prompts", "chunked"])
def test_batched_greedy_equals_hf(make_engine, budget):
    engine = make_engine(max_num_batched_tokens=budget)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    requests = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)]
    got = run_all(engine, requests)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == reference.hf_greedy(p, MAX_TOKENS), reference.PROMPTS[i]


@pytest.mark.parametrize("linear_backend", ["fp32_cpu", "fp32_stream"])
def test_decode_layer_stack_greedy_equals_hf(make_engine, linear_backend):
    """Every GEMM on Tandem's float32 kernels: each decode pass runs its 30 layers as one C call
    (engine.kernels.cpu_decode_layers), and the tokens are still HF's."""
    engine = make_engine(linear_backend=linear_backend)
    stack = engine.runner.model.model._decode_stack()
    if stack is None:
        pytest.skip("the CPU kernels do not compile here")
    taken = []
    run = stack.run
    stack.run = lambda *args: taken.append(run(*args)) or taken[-1]
    try:
        prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
        requests = [Request(f"s{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
                    for i, p in enumerate(prompts)]
        got = run_all(engine, requests)
    finally:
        stack.run = run
    assert sum(out is not None for out in taken) >= MAX_TOKENS - 1  # every all-decode pass
    for i, p in enumerate(prompts):
        assert got[f"s{i}"] == reference.hf_greedy(p, MAX_TOKENS), reference.PROMPTS[i]


def test_preemption_keeps_output_identical(make_engine):
    # 16 blocks of 16 tokens cannot hold 8 prompts of ~30 tokens plus 24 outputs each at once.
    engine = make_engine(num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=256)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    requests = [Request(f"p{i}", p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)) for i, p in enumerate(prompts)]
    before = engine.stats().num_preemptions
    got = run_all(engine, requests)
    assert engine.stats().num_preemptions > before
    for i, p in enumerate(prompts):
        assert got[f"p{i}"] == reference.hf_greedy(p, MAX_TOKENS)


def test_kv_saved_then_loaded_gives_same_tokens(make_engine):
    """Prefill on one engine, ship its KV as bytes, decode on another: the disaggregated path."""
    prefill, decode = make_engine(), make_engine(max_num_batched_tokens=64)
    prompt = reference.chat_ids(reference.PROMPTS[2])
    first = Request("a", prompt, SamplingParams(temperature=0, max_tokens=1))
    out = []
    prefill.add_request(first)
    while prefill.has_unfinished_requests():
        out += prefill.step()
    saved = out[-1].saved_kv
    assert len(saved) == -(-len(prompt) // 16)
    follow = Request("b", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    follow.append_output_token(out[-1].new_token_ids[0])
    got = run_all(decode, [follow], {"b": ExternalKV(len(prompt), saved)})
    assert follow.output_token_ids == reference.hf_greedy(prompt, MAX_TOKENS)
    assert got["b"] == follow.output_token_ids[1:]


def test_seeded_sampling_does_not_depend_on_the_batch(make_engine):
    engine = make_engine()
    prompt = reference.chat_ids(reference.PROMPTS[1])
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = run_all(engine, [Request("s0", prompt, params)])["s0"]
    others = [Request(f"o{i}", reference.chat_ids(p), SamplingParams(temperature=1.0, max_tokens=12))
              for i, p in enumerate(reference.PROMPTS[3:7])]
    busy = run_all(engine, [*others, Request("s1", prompt, params)])["s1"]
    assert alone == busy
