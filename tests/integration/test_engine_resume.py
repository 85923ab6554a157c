"""A request resumed on another engine (decode migration) continues the greedy answer exactly:
prompt + the tokens already sent are recomputed (or loaded from pool blocks), then sampling goes
on, equal to the Hugging Face reference token for token (docs/design.md §8)."""

from __future__ import annotations

import pytest

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.outputs import ExternalKV
from tests import reference

MAX_TOKENS = 24
BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=24)
    return LLMEngine.from_config(config, save_kv_on_finish=True)


def run(engine: LLMEngine, request: Request, external: ExternalKV | None = None) -> list[int]:
    new_tokens = []
    engine.add_request(request, external)
    while engine.has_unfinished_requests():
        for output in engine.step():
            new_tokens += output.new_token_ids
    assert engine.stats().num_used_blocks == 0
    return new_tokens


def prompt_blocks(engine: LLMEngine, prompt: list[int]) -> ExternalKV:
    """The prompt's full blocks as a prefill worker leaves them in the pool."""
    request = Request("prefill", prompt, SamplingParams(temperature=0, max_tokens=1))
    engine.add_request(request)
    saved = None
    while engine.has_unfinished_requests():
        saved = [o.saved_kv for o in engine.step() if o.finished][-1]
    num_full = len(prompt) // BLOCK_SIZE
    return ExternalKV(num_full * BLOCK_SIZE, saved[:num_full])


@pytest.mark.parametrize("num_sent", [1, 9, 23])
@pytest.mark.parametrize("from_pool", [False, True], ids=["recompute", "pool-blocks"])
def test_resumed_request_continues_the_greedy_answer(engine, num_sent, from_pool):
    prompt = reference.chat_ids(reference.PROMPTS[3])
    expected = reference.hf_greedy(prompt, MAX_TOKENS)
    external = prompt_blocks(engine, prompt) if from_pool else None
    request = Request(f"resume-{num_sent}-{from_pool}", prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    for token_id in expected[:num_sent]:
        assert request.append_output_token(token_id) is None
    new_tokens = run(engine, request, external)
    assert new_tokens == expected[num_sent:]  # only tokens after the resumed ones are new
    assert request.output_token_ids == expected
