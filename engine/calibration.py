"""Start-up calibration: a few synthetic passes through the engine, so a fresh worker publishes a
fitted cost model (core.cost_model) and the router predicts TTFT and TBT from the first request.

The passes run through :meth:`LLMEngine.step` (the same code path, and timer, as real traffic):
single prompts of a few sizes (prefill cost per token and per attention pair) and decode batches
of a few sizes, one of them over a long context (per-sequence and decode attention cost).
Afterwards every block is free, the prefix cache is empty and the counters are zero; only the
cost model's samples remain.

With ``cache=True`` the timed samples are kept per machine (:func:`samples_path`: the CPU, torch,
the thread count, the engine's configuration and linear backends, Tandem's CPU kernels) and the
next start built alike feeds them to the fit instead of timing the probes again: only the
warm-up probe runs, and a restarted or added worker serves seconds sooner. The running fit
replaces them as traffic comes (core.cost_model.StepTimeFit's window). Samples timed while other
processes kept the machine busy are timed again by the first start that finds it quiet, as the
linear backends' plan is (engine.model.linear_chooser).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from core.cost_model import StepSample
from core.model_source import cache_dir
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.linear import planned_layers
from engine.model.linear_chooser import BUSY_OTHER_CORES, OtherCpuUse, cpu_identity, other_cores_now

log = logging.getLogger(__name__)

DECODE_TOKENS = 4  # each decode probe: one prefill pass, then DECODE_TOKENS - 1 decode passes
# Changed when the probes or a sample's features change: samples cached the old way are timed again.
SAMPLES_FORMAT = "1: calibration_probes; StepSample(num_new_tokens, num_seqs, attn_pairs, duration_s, forward_s)"
_CPU_KERNELS = Path(__file__).resolve().parent / "kernels" / "cpu"


@dataclass(frozen=True)
class Probe:
    """``num_seqs`` requests of ``num_prompt_tokens`` random tokens, each generating ``max_tokens``."""

    num_seqs: int
    num_prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class CalibrationResult:
    num_steps: int  # passes timed (the warm-up pass excluded), or samples read from the cache
    duration_s: float  # wall time of the whole calibration, warm-up included
    cached: bool = False  # the samples came from this machine's cache


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


def calibrate(engine: LLMEngine, num_steps: int, max_duration_s: float = 5.0, seed: int = 0,
              cache: bool = False) -> CalibrationResult:
    """Runs at least ``num_steps`` timed passes (probes run to completion, so a few more) on an
    idle engine, after one untimed warm-up probe; no new probe starts after ``max_duration_s``
    (a worker on a busy machine starts with fewer samples rather than late; traffic adds more).
    ``cache``: read the samples from this machine's cache when an engine built alike left them
    there (only the warm-up runs), else time them and leave them there (module docstring).

    Mutates: the engine's cost-model samples (kept); its prefix cache (emptied) and its counters
    (preemptions, swaps, evictions, prefix-cache queries and hits, busy time: zeroed); with
    ``cache``, the file at :func:`samples_path`. Raises ValueError if the engine has requests or
    ``num_steps`` < 0.
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
    path = samples_path(engine, num_steps, max_duration_s) if cache else None
    samples = _read_samples(path) if path is not None else None
    if samples is not None:
        for sample in samples:
            engine.step_stats.record(sample)
        _reset(engine)
        return CalibrationResult(len(samples), time.perf_counter() - started, cached=True)
    others = OtherCpuUse()
    first = engine.step_stats.num_steps
    for probe in itertools.cycle(probes):
        if engine.step_stats.num_steps - first >= num_steps or time.perf_counter() - started > max_duration_s:
            break
        _run_probe(engine, probe, rng)
    if path is not None and engine.step_stats.num_steps > first:
        _write_samples(path, engine.step_stats.fit.samples(), others.cores())
    _reset(engine)
    return CalibrationResult(engine.step_stats.num_steps - first, time.perf_counter() - started)


def samples_path(engine: LLMEngine, num_steps: int, max_duration_s: float) -> Path:
    """Where this machine keeps the calibration samples of engines built like ``engine``
    (``$TANDEM_CACHE_DIR/calibration``, core.model_source.cache_dir): named by a digest of the
    CPU, torch and its thread count, the engine's configuration, its layers' linear backends,
    Tandem's CPU kernel sources and the calibration's own arguments."""
    parts = [SAMPLES_FORMAT, cpu_identity(), torch.__version__, str(torch.get_num_threads()), repr(engine.config),
             repr([layer.plan for layer in planned_layers(engine.runner.model)]), f"{num_steps} {max_duration_s}"]
    parts += [hashlib.blake2b(source.read_bytes(), digest_size=8).hexdigest()
              for source in sorted([*_CPU_KERNELS.glob("*.c"), *_CPU_KERNELS.glob("*.h")])]
    key = hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()
    return cache_dir() / "calibration" / f"samples-{key}.json"


def _read_samples(path: Path) -> list[StepSample] | None:
    """The cached samples at ``path``; None when there are none, they are unreadable, or they were
    timed on a busy machine and it is quiet now (then they are timed again)."""
    try:
        data = json.loads(path.read_text())
        samples = [StepSample(int(t), int(s), float(a), float(d), float(f)) for t, s, a, d, f in data["samples"]]
        other_cores = float(data["other_cores"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not samples or (other_cores > BUSY_OTHER_CORES and other_cores_now() <= BUSY_OTHER_CORES):
        return None
    return samples


def _write_samples(path: Path, samples: list[StepSample], other_cores: float) -> None:
    """Writes ``samples`` and the cores other processes used meanwhile (atomically: workers
    starting together may write at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    rows = [[s.num_new_tokens, s.num_seqs, s.attn_pairs, s.duration_s, s.forward_s] for s in samples]
    tmp.write_text(json.dumps({"format": SAMPLES_FORMAT, "samples": rows, "other_cores": other_cores}))
    os.replace(tmp, path)


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
