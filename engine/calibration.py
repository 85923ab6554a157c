"""Start-up calibration: a few synthetic passes through the engine, so a fresh worker publishes a
fitted cost model (core.cost_model) and the router predicts TTFT and TBT from the first request.

The passes run through :meth:`LLMEngine.step` (the same code path, and timer, as real traffic):
single prompts of a few sizes (prefill cost per token and per attention pair) and decode batches
of a few sizes, one of them over a long context (per-sequence and decode attention cost).
Afterwards every block is free, the prefix cache is empty and the counters are zero; only the
cost model's samples remain.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from dataclasses import dataclass

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine

log = logging.getLogger(__name__)

DECODE_TOKENS = 4  # each decode probe: one prefill pass, then DECODE_TOKENS - 1 decode passes


@dataclass(frozen=True)
class Probe:
    """``num_seqs`` requests of ``num_prompt_tokens`` random tokens, each generating ``max_tokens``."""

    num_seqs: int
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class CalibrationResult:
    num_steps: int  # passes timed (the warm-up pass excluded)
    duration_s: float  # wall time of the whole calibration, warm-up included


def calibration_probes(config: EngineConfig) -> list[Probe]:
    """Prompts of 16, 128 and 256 tokens alternating with decode batches of 2, 8 and 16
    sequences and one long-context decode (19 passes in all with a budget >= 256); every probe
    fits ``max_model_len``, ``max_num_seqs`` and the KV cache (sizes are clipped, duplicates
    dropped)."""
    limit = config.max_model_len
    probes = []
    shapes = [(1, 16, 1), (2, 16, DECODE_TOKENS), (1, 128, 1), (8, 16, DECODE_TOKENS), (1, 256, 1),
              (1, 192, DECODE_TOKENS), (16, 16, DECODE_TOKENS)]
    for num_seqs, num_prompt_tokens, max_tokens in shapes:
        max_tokens = min(max_tokens, limit - 1)
        num_prompt_tokens = max(1, min(num_prompt_tokens, limit - max_tokens))
        blocks_each = -(-(num_prompt_tokens + max_tokens) // config.block_size)
        num_seqs = max(1, min(num_seqs, config.max_num_seqs, config.num_kv_blocks // blocks_each))
        probe = Probe(num_seqs, num_prompt_tokens, max_tokens)
        if probe not in probes:
            probes.append(probe)
    return probes


def calibrate(engine: LLMEngine, num_steps: int, max_duration_s: float = 5.0, seed: int = 0) -> CalibrationResult:
    """Runs at least ``num_steps`` timed passes (probes run to completion, so a few more) on an
    idle engine, after one untimed warm-up probe; no new probe starts after ``max_duration_s``
    (a worker on a busy machine starts with fewer samples rather than late; traffic adds more).

    Mutates: the engine's cost-model samples (kept); its prefix cache (emptied) and its counters
    (preemptions, swaps, evictions, prefix-cache queries and hits, busy time: zeroed). Raises ValueError if the engine has requests or ``num_steps`` < 0.
    """
    if num_steps < 0:
        raise ValueError(f"num_steps must be >= 0, got {num_steps}")
    if engine.has_unfinished_requests():
        raise ValueError("calibrate needs an idle engine")
    started = time.perf_counter()
    if num_steps == 0:
        return CalibrationResult(0, 0.0)
    rng = random.Random(seed)
    probes = calibration_probes(engine.config)
    _run_probe(engine, probes[0], rng)  # warm-up: first-call allocations are not a step's cost
    engine.step_stats.fit.clear()
    first = engine.step_stats.num_steps
    for probe in itertools.cycle(probes):
        if engine.step_stats.num_steps - first >= num_steps or time.perf_counter() - started > max_duration_s:
            break
        _run_probe(engine, probe, rng)
    _reset(engine)
    return CalibrationResult(engine.step_stats.num_steps - first, time.perf_counter() - started)


def _run_probe(engine: LLMEngine, probe: Probe, rng: random.Random) -> None:
    vocab_size = engine.runner.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=probe.max_tokens, min_tokens=probe.max_tokens)
    for i in range(probe.num_seqs):
        prompt = [rng.randrange(3, vocab_size) for _ in range(probe.num_prompt_tokens)]
        engine.add_request(Request(f"calibration-{rng.getrandbits(64):016x}-{i}", prompt, params))
    while engine.has_unfinished_requests():
        engine.step()


def _reset(engine: LLMEngine) -> None:
    """Leaves the engine as a fresh one, but for the cost model's samples."""
    engine.scheduler.reset_cache_and_counters()
    engine.num_swapped_out = 0
    engine.runner.busy_time_s = 0.0
    engine.step_stats.forget_last()
