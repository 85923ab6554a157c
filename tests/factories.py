"""Factories for tests built from plain ints: requests, schedulers, a fake model runner."""

from __future__ import annotations

import itertools

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SampledToken, SchedulerOutput
from engine.scheduler import Scheduler

_ids = itertools.count()


def make_request(num_prompt_tokens: int, max_tokens: int = 4, request_id: str | None = None, **params) -> Request:
    prompt = [(7 * i + 3) % 1000 + 3 for i in range(num_prompt_tokens)]
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        eos_token_id=2,
    )


def make_scheduler(**overrides) -> Scheduler:
    defaults = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128)
    return Scheduler(EngineConfig(**{**defaults, **overrides}))


def fake_runner_output(out: SchedulerOutput, token_id: int = 100) -> ModelRunnerOutput:
    """Samples ``token_id`` for every request whose step reaches its last token."""
    return ModelRunnerOutput({s.request.request_id: SampledToken(token_id) for s in out.scheduled if s.samples})
