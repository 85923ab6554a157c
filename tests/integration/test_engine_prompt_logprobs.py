"""Prompt logprobs from the engine on the real model against the Hugging Face reference: whole and
chunked prefills, a prompt the prefix cache already holds, and preemption (no position twice)."""

from __future__ import annotations

import pytest
import torch

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from tests import reference

NUM_TOP = 3


def run(engine: LLMEngine, requests: list[Request]) -> dict[str, list]:
    """Each request's prompt logprobs (from the output of its first token)."""
    got = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in got
                got[o.request_id] = o.prompt_logprobs
    assert engine.stats().num_used_blocks == 0
    return got


def assert_equal_hf(prompt_ids: list[int], got: list) -> None:
    expected = reference.hf_prompt_logprobs(tuple(prompt_ids))
    assert [s.token_id for s in got] == prompt_ids[1:]
    for position, s in enumerate(got):  # position p predicts prompt token p + 1
        assert s.logprob == pytest.approx(float(expected[position, s.token_id]), abs=2e-3)
        values, ids = torch.topk(expected[position], NUM_TOP)
        assert [t for t, _ in s.top_logprobs] == ids.tolist()
        assert [v for _, v in s.top_logprobs] == pytest.approx(values.tolist(), abs=2e-3)


@pytest.mark.parametrize("budget", [512, 24], ids=["whole-prompts", "chunked"])
def test_prompt_logprobs_equal_hf_and_skip_the_prefix_cache(budget):
    config = EngineConfig(block_size=16, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=budget)
    engine = LLMEngine.from_config(config)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS[:3]]
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=NUM_TOP)
    for round_ in range(2):  # the second round's prompts are in the prefix cache: computed all the same
        got = run(engine, [Request(f"r{round_}-{i}", p, params) for i, p in enumerate(prompts)])
        for i, p in enumerate(prompts):
            assert_equal_hf(p, got[f"r{round_}-{i}"])
    plain = run(engine, [Request("plain", prompts[0], SamplingParams(temperature=0, max_tokens=2))])
    assert plain == {}  # none unless asked


def test_preempted_prompt_logprobs_are_not_repeated():
    # 16 blocks of 16 tokens cannot hold 8 prompts of ~30 tokens plus 24 outputs each at once:
    # preempted requests are recomputed, their prompt positions with them.
    config = EngineConfig(block_size=16, num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=256)
    engine = LLMEngine.from_config(config)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, prompt_logprobs=NUM_TOP)
    before = engine.stats().num_preemptions
    got = run(engine, [Request(f"p{i}", p, params) for i, p in enumerate(prompts)])
    assert engine.stats().num_preemptions > before
    for i, p in enumerate(prompts):
        assert_equal_hf(p, got[f"p{i}"])
