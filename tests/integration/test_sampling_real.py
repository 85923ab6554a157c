"""Sampling on the real model through the engine alone: logprobs against Hugging Face, seeded
requests independent of their batch, min_tokens holding EOS back."""

from __future__ import annotations

import pytest
import torch

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from tests import reference

MAX_TOKENS = 12
LOGPROB_TOLERANCE = 1e-4  # fp32 engine vs fp32 HF


def make_engine(**overrides) -> LLMEngine:
    config = dict(block_size=16, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=512)
    return LLMEngine.from_config(EngineConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


def run_all(engine: LLMEngine, requests: list[Request]) -> dict[str, list]:
    """Runs ``requests`` to the end; request id -> its RequestOutputs, in order."""
    outputs = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id].append(o)
    return outputs


def test_greedy_logprobs_equal_hf_log_softmax(engine: LLMEngine) -> None:
    prompt = reference.chat_ids(reference.PROMPTS[0])
    request = Request("lp", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3))
    outputs = run_all(engine, [request])["lp"]
    sampled = [s for o in outputs for s in o.logprobs]
    tokens = request.output_token_ids
    assert [s.token_id for s in sampled] == tokens == reference.hf_greedy(prompt, MAX_TOKENS)
    with torch.inference_mode():
        logits = reference.hf_model()(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    expected = torch.log_softmax(logits.float(), -1)  # [num_output_tokens, vocab]
    for i, s in enumerate(sampled):
        assert s.logprob == pytest.approx(float(expected[i, s.token_id]), abs=LOGPROB_TOLERANCE), i
        top_values, top_ids = torch.topk(expected[i], 3)
        assert [t for t, _ in s.top_logprobs][0] == s.token_id == int(top_ids[0])  # greedy: the best
        assert [v for _, v in s.top_logprobs] == pytest.approx(top_values.tolist(), abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap-multistep"])
def test_seeded_penalised_request_is_identical_alone_and_in_a_busy_batch(engine: LLMEngine, overlap: bool) -> None:
    """Alone on the plain engine; busy on the plain one, or on one with overlap and multi-step
    decode, where the penalties must see real tokens, never the placeholders of the step still
    running."""
    busy_engine = make_engine(enable_overlap=True, num_scheduler_steps=4) if overlap else engine
    prompt = reference.chat_ids(reference.PROMPTS[1])
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=MAX_TOKENS, presence_penalty=0.4,
                            frequency_penalty=0.3, repetition_penalty=1.2, logprobs=1)
    alone = run_all(engine, [Request("s0", prompt, params)])["s0"]
    others = [Request(f"o{i}", reference.chat_ids(p), SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS,
                                                                      repetition_penalty=1.1))
              for i, p in enumerate(reference.PROMPTS[3:7])]
    busy = run_all(busy_engine, [*others, Request("s1", prompt, params)])["s1"]

    def tokens(outputs):
        return [t for o in outputs for t in o.new_token_ids]

    assert tokens(alone) == tokens(busy)
    assert [s.logprob for o in alone for s in o.logprobs] == pytest.approx(
        [s.logprob for o in busy for s in o.logprobs], abs=LOGPROB_TOLERANCE)


def test_min_tokens_holds_eos_back(engine: LLMEngine) -> None:
    prompt = reference.chat_ids(reference.PROMPTS[0])  # "What is the capital of France?": a short answer
    free = Request("free", prompt, SamplingParams(temperature=0, max_tokens=64))
    run_all(engine, [free])
    assert free.output_token_ids[-1] == engine.eos_token_id, "the reference answer should end with EOS"
    min_tokens = len(free.output_token_ids) + 4
    held = Request("held", prompt, SamplingParams(temperature=0, max_tokens=64, min_tokens=min_tokens))
    run_all(engine, [held])
    assert len(held.output_token_ids) >= min_tokens
    assert engine.eos_token_id not in held.output_token_ids[:min_tokens]
    assert held.output_token_ids[: len(free.output_token_ids) - 1] == free.output_token_ids[:-1]
