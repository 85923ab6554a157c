"""Chooses each linear layer's GEMM backend by measurement, once per machine.

The fastest GEMM for a weight depends on the CPU (AVX2, AVX-512, AVX512-BF16, AMX), the library
versions, the thread count, the weight's shape and M, the tokens in the step. So instead of a
rule, the worker times every candidate backend (:data:`engine.model.linear.BACKENDS`) on the
model's real weight shapes at the M buckets it will see:

- decode steps: M = 1 .. ``max_num_seqs`` (every layer, the LM head included);
- prefill chunks: M up to ``max_num_batched_tokens`` (every layer but the LM head, which only
  sees the sampled rows, at most ``max_num_seqs``),

and keeps the fastest per (shape, M bucket). The plan is cached as JSON in the Tandem cache
folder, keyed by the CPU's model name and instruction-set flags, torch / MKL / oneDNN versions,
the thread count, the dtype and the shapes, so later starts of the same machine read it in
milliseconds (the C attention kernel is cached the same way: engine.kernels.cpu_decode_attention).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from core.model_source import cache_dir
from engine.model.linear import (BACKENDS, LINEAR_BACKEND_CHOICES, Linear, backend_supports, bucket_m, m_bucket,
                                 planned_layers, prepare_weight, run_backend)

log = logging.getLogger(__name__)

# Seconds of calls each (shape, M, backend) is timed for, after one warm-up call; at least
# MIN_CALLS calls. The minimum over the calls is kept (the least disturbed by other processes).
TIME_PER_CANDIDATE_S = 0.02
MIN_CALLS = 5
# A backend within this fraction of an earlier one in BACKENDS' order counts as a tie: timings
# on a shared machine move by 10 % from run to run, and a flip on noise is worse than the order.
TIE_MARGIN = 0.10
# Buckets past this M are timed at it: large GEMMs are compute-bound and rank the backends as at
# 512 rows, and timing a 2048-row GEMM three times per backend would triple the start-up cost.
MAX_TIMED_M = 512


@dataclass(frozen=True)
class LinearSetup:
    """How a loaded model's linear layers get their GEMM backends.

    ``backend``: "auto" measures (or reads the cached measurement); a backend name forces it on
    every layer it can run (others keep ``torch``). ``max_num_seqs`` / ``max_num_batched_tokens``:
    the engine's, they bound the M buckets measured.

    Raises:
        ValueError: an unknown backend, or a size below 1.
    """

    backend: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    use_cache: bool = True

    def __post_init__(self) -> None:
        if self.backend not in LINEAR_BACKEND_CHOICES:
            raise ValueError(f"linear_backend must be one of {LINEAR_BACKEND_CHOICES}, got {self.backend!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_seqs} and {self.max_num_batched_tokens}")


@dataclass
class LinearPlan:
    """Per weight shape ``"{out}x{in}"``: the backend of each M bucket (bucket b = M in
    (2^(b-1), 2^b]) and, when measured, each candidate's best ms per bucket."""

    choices: dict[str, list[str]]
    timings_ms: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)
    took_s: float = 0.0
    cached: bool = False
    # 1-minute load average per core while it was measured (above BUSY_LOAD_PER_CORE: busy).
    load_per_core: float = 0.0

    def summary(self) -> str:
        """One line for the start-up log: "onednn for 5 shapes (24 buckets), mkl for ..."."""
        per_backend = Counter(b for plan in self.choices.values() for b in plan)
        shapes = {b: sum(b in plan for plan in self.choices.values()) for b in per_backend}
        parts = [f"{b} for {shapes[b]} shapes ({per_backend[b]} buckets)" for b in BACKENDS if b in per_backend]
        how = "read from the cache" if self.cached else f"chosen in {self.took_s:.1f} s"
        return f"linear backends: {', '.join(parts) or 'none'}, {how}"


def shape_key(weight: torch.Tensor) -> str:
    return f"{weight.shape[0]}x{weight.shape[1]}"


def _layer_buckets(model: nn.Module, setup: LinearSetup) -> dict[str, tuple[torch.Tensor, int]]:
    """Shape key -> (a weight of that shape, number of M buckets to measure)."""
    lm_head = getattr(model, "lm_head", None)
    decode_buckets = m_bucket(setup.max_num_seqs) + 1
    prefill_buckets = max(decode_buckets, m_bucket(setup.max_num_batched_tokens) + 1)
    shapes: dict[str, tuple[torch.Tensor, int]] = {}
    for layer in planned_layers(model):
        weight = layer.weight.detach()
        buckets = decode_buckets if layer is lm_head else prefill_buckets
        key = shape_key(weight)
        if key not in shapes or shapes[key][1] < buckets:
            shapes[key] = (weight, buckets)
    return shapes


def time_backends_ms(prepared: dict[str, torch.Tensor | None], weight: torch.Tensor, m: int) -> dict[str, float]:
    """Best ms of one GEMM of ``m`` random rows against ``weight`` through each backend of
    ``prepared`` (backend -> its prepared weight). The backends take turns call by call, so a
    burst of load from another process slows them alike instead of one of them."""
    x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
    best_s = {}
    for backend, w in prepared.items():
        run_backend(backend, x, w, weight, None)  # warm-up: primitive creation, caches
        best_s[backend] = float("inf")
    calls, started = 0, time.perf_counter()
    budget_s = TIME_PER_CANDIDATE_S * len(prepared)
    while calls < MIN_CALLS or time.perf_counter() - started < budget_s:
        for backend, w in prepared.items():
            t0 = time.perf_counter()
            run_backend(backend, x, w, weight, None)
            best_s[backend] = min(best_s[backend], time.perf_counter() - t0)
        calls += 1
    return {backend: s * 1e3 for backend, s in best_s.items()}


def fastest(times_ms: dict[str, float]) -> str:
    """The fastest backend; one within TIE_MARGIN of an earlier one in BACKENDS' order loses to it
    (a measured tie is noise: keep the order's preference, not a coin flip per machine)."""
    best = min(times_ms.values())
    return next(b for b in BACKENDS if b in times_ms and times_ms[b] <= best * (1 + TIE_MARGIN))


def measure(shapes: dict[str, tuple[torch.Tensor, int]], candidates: tuple[str, ...]) -> LinearPlan:
    """Times every candidate on every shape and M bucket; keeps the fastest per bucket."""
    started = time.perf_counter()
    choices: dict[str, list[str]] = {}
    timings: dict[str, dict[str, list[float | None]]] = {}
    for key, (weight, num_buckets) in sorted(shapes.items()):
        prepared = {b: prepare_weight(b, weight) for b in candidates if backend_supports(b, weight)}
        if len(prepared) == 1:  # nothing to choose from (a CUDA weight: F.linear only)
            choices[key] = list(prepared) * num_buckets
            continue
        per_bucket = [time_backends_ms(prepared, weight, min(bucket_m(k), MAX_TIMED_M)) for k in range(num_buckets)]
        timings[key] = {b: [round(t[b], 4) for t in per_bucket] for b in prepared}
        choices[key] = [fastest(t) for t in per_bucket]
    return LinearPlan(choices, timings, took_s=time.perf_counter() - started)


def machine_key(dtype: torch.dtype, shapes: dict[str, tuple[torch.Tensor, int]]) -> str:
    """A digest of everything a measured plan depends on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                cpu += line + "\n"
    except OSError:
        cpu = platform.processor()
    parts = [cpu, torch.__version__, torch.__config__.show(), str(torch.get_num_threads()), str(dtype),
             repr(sorted((k, n) for k, (_, n) in shapes.items()))]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


# Above this 1-minute load average per core a measurement counts as made on a busy machine.
BUSY_LOAD_PER_CORE = 1.0


def _load_per_core() -> float:
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except OSError:
        return 0.0


def plan_path(key: str) -> Path:
    return cache_dir() / "linear" / f"plan-{key}.json"


def _read_cached(path: Path) -> LinearPlan | None:
    try:
        data = json.loads(path.read_text())
        return LinearPlan(data["choices"], data.get("timings_ms", {}), data.get("took_s", 0.0), cached=True,
                          load_per_core=data.get("load_per_core", 0.0))
    except (OSError, ValueError, KeyError):
        return None


def _write_cached(path: Path, plan: LinearPlan) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # tensor-parallel ranks may write at once
    tmp.write_text(json.dumps({"choices": plan.choices, "timings_ms": plan.timings_ms, "took_s": plan.took_s,
                               "load_per_core": plan.load_per_core}))
    os.replace(tmp, path)


def choose_plan(model: nn.Module, setup: LinearSetup) -> LinearPlan:
    """The plan for ``model``'s linear layers: forced (``setup.backend`` names one), read from the
    machine's cache, or measured now and cached."""
    shapes = _layer_buckets(model, setup)
    if not shapes:
        return LinearPlan({})
    if setup.backend != "auto":
        choices = {}
        for key, (weight, num_buckets) in shapes.items():
            backend = setup.backend if backend_supports(setup.backend, weight) else "torch"
            choices[key] = [backend] * num_buckets
        return LinearPlan(choices)
    dtype = next(iter(shapes.values()))[0].dtype
    path = plan_path(machine_key(dtype, shapes))
    if not setup.use_cache:
        return _measure_now(shapes)
    # One process of the machine measures at a time (workers starting together would time each
    # other's GEMMs); the next one then finds the plan cached if it needs the same one.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".measure.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _cached_or_measured(path, shapes)


def _cached_or_measured(path: Path, shapes: dict[str, tuple[torch.Tensor, int]]) -> LinearPlan:
    load_now = _load_per_core()
    cached = _read_cached(path)
    if cached is not None and set(cached.choices) == set(shapes):
        # A plan measured on a busy machine is kept until a start finds the machine quiet.
        if cached.load_per_core <= BUSY_LOAD_PER_CORE or load_now > BUSY_LOAD_PER_CORE:
            return cached
    plan = _measure_now(shapes, load_now)
    _write_cached(path, plan)
    return plan


def _measure_now(shapes: dict[str, tuple[torch.Tensor, int]], load_before: float | None = None) -> LinearPlan:
    load_before = _load_per_core() if load_before is None else load_before
    plan = measure(shapes, BACKENDS)
    plan.load_per_core = max(load_before, _load_per_core())
    if plan.load_per_core > BUSY_LOAD_PER_CORE:
        # Timings of a busy machine measure the other processes as much as the GEMMs.
        log.warning("linear backends measured while the machine was busy (load %.1f per core): the first "
                    "start on a quiet machine measures them again", plan.load_per_core)
    return plan


def plan_linears(model: nn.Module, setup: LinearSetup) -> LinearPlan:
    """Chooses (:func:`choose_plan`) and applies a backend plan to every :class:`Linear` of
    ``model``, logging one summary line. Mutates the layers (prepared weight copies)."""
    plan = choose_plan(model, setup)
    for layer in planned_layers(model):
        choice = plan.choices.get(shape_key(layer.weight))
        if choice is None or set(choice) == {"torch"}:
            layer.clear_plan()
        else:
            layer.set_plan(tuple(choice))
    log.info("%s", plan.summary())
    return plan


__all__ = ["LinearPlan", "LinearSetup", "Linear", "choose_plan", "plan_linears", "measure"]
