"""Chooses each linear layer's GEMM backend by measurement, once per machine.

The fastest GEMM for a weight depends on the CPU (AVX2, AVX-512, AVX512-BF16, AMX), the library
versions, the thread count, the weight's shape and M, the tokens in the step. So instead of a
rule, the worker times every candidate backend (:data:`engine.model.linear.BACKENDS`) on the
model's real weight shapes at the M buckets it will see:

- decode steps: M = 1 .. ``max_num_seqs`` (every layer, the LM head included);
- prefill chunks: M up to ``max_num_batched_tokens`` (every layer but the LM head, which only
  sees the sampled rows, at most ``max_num_seqs``),

and keeps the fastest per (shape, M bucket). Each candidate is timed on weights that come from
DRAM, as in a forward pass (where the whole model streams through the caches between two uses of
one layer): the calls rotate through enough copies of the weight to overflow the last-level cache
(:func:`num_weight_copies`). Timing one weight over and over would time it hot in L2/L3 and can
rank the backends the other way round for the small weights. The plan is cached as JSON in the Tandem cache
folder, keyed by the CPU's model name and instruction-set flags, torch / MKL / oneDNN versions,
the thread count, the dtype and the shapes, so later starts of the same machine read it in
milliseconds (the C attention kernel is cached the same way: engine.kernels.cpu_decode_attention).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import math
import os
import platform
import resource
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from core.model_source import cache_dir
from engine.config import EngineConfig
from engine.model.linear import (BACKENDS, INT8_BACKENDS, LINEAR_BACKEND_CHOICES, SAME_RESULT, Linear, backend_supports,
                                 bind_backend, bucket_m, fallback_backend, m_bucket, planned_layers, prepare_weight)

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
# The copies of a weight the calls rotate through span at least this many times the last-level
# cache (so each call reads its weight from DRAM), at most MAX_WEIGHT_COPIES copies.
COLD_CACHE_FACTOR = 2
MAX_WEIGHT_COPIES = 64
_DEFAULT_LLC_BYTES = 32 << 20


def last_level_cache_bytes() -> int:
    """The largest CPU cache of CPU 0, in bytes (sysfs); 32 MiB where sysfs does not say."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[text[-1]])
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return max(sizes, default=_DEFAULT_LLC_BYTES)


def num_weight_copies(weight: torch.Tensor, llc_bytes: int | None = None) -> int:
    """How many copies of ``weight`` the timed calls rotate through: enough to span
    COLD_CACHE_FACTOR x the last-level cache, 1 for a weight that alone does, at most
    MAX_WEIGHT_COPIES."""
    llc_bytes = last_level_cache_bytes() if llc_bytes is None else llc_bytes
    nbytes = weight.numel() * weight.element_size()
    return max(1, min(MAX_WEIGHT_COPIES, math.ceil(COLD_CACHE_FACTOR * llc_bytes / max(1, nbytes))))


@dataclass(frozen=True)
class LinearSetup:
    """How a loaded model's linear layers get their GEMM backends.

    ``backend``: "auto" measures (or reads the cached measurement); a backend name forces it on
    every layer it can run (others keep ``torch``, an int8 layer ``int8_dequant``).
    ``max_num_seqs`` / ``max_num_batched_tokens``: the engine's, they bound the M buckets measured.

    Raises:
        ValueError: an unknown backend, or a size below 1.
    """

    backend: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    use_cache: bool = True

    @classmethod
    def from_config(cls, config: EngineConfig) -> LinearSetup:
        """The setup of an engine's model: its ``linear_backend``, and the M its steps can reach."""
        return cls(config.linear_backend, config.max_num_seqs, config.max_num_batched_tokens)

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
    # Cores the machine's other processes kept busy, on average, while it was measured (above
    # BUSY_OTHER_CORES: measured busy).
    other_cores: float = 0.0
    forced: bool = False  # named by --linear-backend, not measured

    def summary(self) -> str:
        """One line for the start-up log: "onednn for 5 shapes (24 buckets), mkl for ..."."""
        per_backend = Counter(b for plan in self.choices.values() for b in plan)
        shapes = {b: sum(b in plan for plan in self.choices.values()) for b in per_backend}
        parts = [f"{b} for {shapes[b]} shapes ({per_backend[b]} buckets)" for b in BACKENDS if b in per_backend]
        how = "forced by --linear-backend" if self.forced else "read from the cache" if self.cached \
            else f"chosen in {self.took_s:.1f} s"
        int8 = [key for key in self.choices if key.startswith("int8")]
        w8a8 = sum(key.startswith("int8a8:") for key in int8)
        quantized = f" (int8 weights: {len(int8)} shapes, {w8a8} of them with 8-bit activations)" if int8 else ""
        return f"linear backends: {', '.join(parts) or 'none'}{quantized}, {how}"


def shape_key(weight: torch.Tensor, activation_bits: int = 16) -> str:
    """``"{out}x{in}"``, ``"int8:{out}x{in}"`` for a quantised layer's int8 weight,
    ``"int8a8:{out}x{in}"`` for a W8A8 layer's (8-bit activations: other kernels, other timings)."""
    prefix = "" if weight.dtype != torch.int8 else "int8a8:" if activation_bits == 8 else "int8:"
    return f"{prefix}{weight.shape[0]}x{weight.shape[1]}"


def activation_bits_of(key: str) -> int:
    """The activation bits of a :func:`shape_key`: 8 for a W8A8 layer's, else 16."""
    return 8 if key.startswith("int8a8:") else 16


def _layer_buckets(model: nn.Module, setup: LinearSetup) -> dict[str, tuple[torch.Tensor, int]]:
    """Shape key -> (a weight of that shape, number of M buckets to measure)."""
    lm_head = getattr(model, "lm_head", None)
    decode_buckets = m_bucket(setup.max_num_seqs) + 1
    prefill_buckets = max(decode_buckets, m_bucket(setup.max_num_batched_tokens) + 1)
    shapes: dict[str, tuple[torch.Tensor, int]] = {}
    for layer in planned_layers(model):
        weight = layer.gemm_weight.detach()
        buckets = decode_buckets if layer is lm_head else prefill_buckets
        key = shape_key(weight, layer.activation_bits)
        if key not in shapes or shapes[key][1] < buckets:
            shapes[key] = (weight, buckets)
    return shapes


def time_backends_ms(prepared: dict[str, list[torch.Tensor | None]], weights: list[torch.Tensor],
                     m: int, activation_bits: int = 16) -> dict[str, float]:
    """Best ms of one GEMM of ``m`` random rows against a weight through each backend of
    ``prepared`` (backend -> its prepared copy of each of ``weights``, equal copies of one weight).
    Call ``i`` reads copy ``i % len(weights)``, so with enough copies every call finds its weight
    out of the caches. The backends take turns call by call, so a burst of load from another
    process slows them alike instead of one of them, and each call reads the copy after the
    previous call's: a backend that ran right after another on the same copy would find that
    weight in the caches (MKL's packed GEMM reads the plain weight too at some M, which made
    ``F.linear`` after it look 2-4x faster than it runs in a pass)."""
    int8 = weights[0].dtype == torch.int8  # a quantised layer's: float32 activations, unit scales
    x = torch.randn(m, weights[0].shape[1], dtype=torch.float32 if int8 else weights[0].dtype, device=weights[0].device)
    scale = torch.ones(weights[0].shape[0], device=weights[0].device) if int8 else None
    # Each copy bound as a layer binds it (Linear.set_plan): the calls timed are the ones a pass makes.
    bound = {backend: [bind_backend(backend, p, w, None, scale, activation_bits) for p, w in zip(copies, weights)]
             for backend, copies in prepared.items()}
    best_s = {}
    for backend, calls_of in bound.items():
        calls_of[0](x)  # warm-up: primitive creation
        best_s[backend] = float("inf")
    calls, started = 0, time.perf_counter()
    budget_s = TIME_PER_CANDIDATE_S * len(prepared)
    i = 0  # copy 0 was the warm-ups': it is in the caches
    while calls < MIN_CALLS or time.perf_counter() - started < budget_s:
        for backend, calls_of in bound.items():
            i = (i + 1) % len(weights)
            t0 = time.perf_counter()
            calls_of[i](x)
            best_s[backend] = min(best_s[backend], time.perf_counter() - t0)
        calls += 1
    return {backend: s * 1e3 for backend, s in best_s.items()}


def fastest(times_ms: dict[str, float]) -> str:
    """The fastest backend; one within TIE_MARGIN of an earlier one in BACKENDS' order loses to it
    (a measured tie is noise: keep the order's preference, not a coin flip per machine). Backends
    that give the same result bit for bit (engine.model.linear.SAME_RESULT: schedules of one
    kernel) stand as one in that order, with their faster member's time: which of them runs
    changes the speed only, so the faster one is kept however small its lead."""
    members: dict[str, str] = {}  # the order's entry -> its fastest member
    for backend, ms in times_ms.items():
        entry = SAME_RESULT.get(backend, backend)
        if entry not in members or ms < times_ms[members[entry]]:
            members[entry] = backend
    best = min(times_ms.values())
    return next(members[b] for b in BACKENDS if b in members and times_ms[members[b]] <= best * (1 + TIE_MARGIN))


def measure(shapes: dict[str, tuple[torch.Tensor, int]], candidates: tuple[str, ...]) -> LinearPlan:
    """Times every candidate on every shape and M bucket; keeps the fastest per bucket."""
    started = time.perf_counter()
    choices: dict[str, list[str]] = {}
    timings: dict[str, dict[str, list[float | None]]] = {}
    for key, (weight, num_buckets) in sorted(shapes.items()):
        bits = activation_bits_of(key)
        runnable = [b for b in candidates if backend_supports(b, weight, bits)]
        if len(runnable) == 1:  # nothing to choose from (a CUDA weight: F.linear only)
            choices[key] = runnable * num_buckets
            continue
        weights = [weight] + [weight.clone() for _ in range(num_weight_copies(weight) - 1)]
        prepared: dict[str, list[torch.Tensor | None]] = {}
        for b in sorted(runnable, key=lambda b: b in SAME_RESULT):  # a shared layout is prepared once
            owner = SAME_RESULT.get(b)
            prepared[b] = prepared[owner] if owner in prepared else [prepare_weight(b, w, bits) for w in weights]
        # Buckets past MAX_TIMED_M are all timed at it: once, shared by them.
        timed_m = [min(bucket_m(k), MAX_TIMED_M) for k in range(num_buckets)]
        by_m = {m: time_backends_ms(prepared, weights, m, bits) for m in dict.fromkeys(timed_m)}
        per_bucket = [by_m[m] for m in timed_m]
        del weights, prepared
        timings[key] = {b: [round(t[b], 4) for t in per_bucket] for b in runnable}
        choices[key] = [fastest(t) for t in per_bucket]
    return LinearPlan(choices, timings, took_s=time.perf_counter() - started)


# Changed when the way a plan is measured changes, so plans cached the old way are measured again.
PLAN_FORMAT = ("8: the bound calls a layer makes timed (bind_backend), W8A8 layers apart; one plan per shape set, "
               "read for any number of buckets it covers; fp32_stream a candidate")
# Plans also depend on Tandem's own kernels: float32 layers' on engine.kernels.cpu_fp32_linear,
# int8 layers' on engine.kernels.cpu_int8_linear.
_KERNELS = Path(__file__).resolve().parents[1] / "kernels" / "cpu"
_FP32_KERNEL, _INT8_KERNEL = _KERNELS / "fp32_linear.c", _KERNELS / "int8_linear.c"


def cpu_identity() -> str:
    """This CPU's model name and instruction-set flags (/proc/cpuinfo), or the platform's name."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                cpu += line + "\n"
    except OSError:
        cpu = platform.processor()
    return cpu


def machine_key(dtype: torch.dtype, shapes: dict[str, tuple[torch.Tensor, int]]) -> str:
    """A digest of everything a measured plan depends on but the number of M buckets (bucket b
    is timed at the same M whatever their number: a plan of more buckets holds one of fewer)."""
    parts = [PLAN_FORMAT, cpu_identity(), torch.__version__, torch.__config__.show(), str(torch.get_num_threads()), str(dtype),
             repr(sorted(shapes))]
    int8 = any(key.startswith("int8") for key in shapes)
    kernel = _INT8_KERNEL if int8 else _FP32_KERNEL
    if kernel.is_file():
        parts.append(hashlib.blake2b(kernel.read_bytes(), digest_size=8).hexdigest())
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=8).hexdigest()


# Above this many cores used by other processes (mean over the measurement) a plan counts as
# measured on a busy machine. A quiet machine's daemons take ~0.02 core; one other busy thread
# of a 2-core machine takes 1 core and makes every GEMM barrier wait for a time slice.
BUSY_OTHER_CORES = 0.25
# Seconds a start watches the machine before deciding whether a busy plan is measured again.
QUIET_PROBE_S = 0.3


class OtherCpuUse:
    """Cores used by processes other than this one between construction and :meth:`cores`:
    the machine's busy CPU time (``/proc/stat``: user, nice, system, irq, softirq, steal) minus
    this process's (``getrusage``), over the wall time. Steal counts: a hypervisor's other
    guests slow the GEMMs as other processes do. 0.0 where ``/proc/stat`` cannot be read.

    The 1-minute load average that this replaces lags: it still counted a benchmark that had
    ended, and missed a test that ran during a 10 s measurement (its timings showed 16 ms
    stalls, time slices, at a load of 0.6 per core)."""

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        except OSError:
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
        busy_s = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
        own = resource.getrusage(resource.RUSAGE_SELF)
        return time.monotonic(), busy_s, own.ru_utime + own.ru_stime

    def seconds(self) -> tuple[float, float, float]:
        """(wall, the machine's busy CPU, this process's CPU) seconds since construction; zeros
        where ``/proc/stat`` cannot be read."""
        end = self._sample()
        if self._start is None or end is None:
            return 0.0, 0.0, 0.0
        return tuple(b - a for a, b in zip(self._start, end))

    def cores(self) -> float:
        """Mean cores other processes used since construction (>= 0)."""
        wall_s, machine_s, own_s = self.seconds()
        return max(0.0, (machine_s - own_s) / wall_s) if wall_s > 0 else 0.0


def other_cores_now() -> float:
    """Cores other processes use over the next QUIET_PROBE_S seconds."""
    use = OtherCpuUse()
    time.sleep(QUIET_PROBE_S)  # the window measured, not a wait for an event
    return use.cores()


def plan_path(key: str) -> Path:
    return cache_dir() / "linear" / f"plan-{key}.json"


def _read_cached(path: Path) -> LinearPlan | None:
    try:
        data = json.loads(path.read_text())
        return LinearPlan(data["choices"], data.get("timings_ms", {}), data.get("took_s", 0.0), cached=True,
                          other_cores=data.get("other_cores", 0.0))
    except (OSError, ValueError, KeyError):
        return None


def _write_cached(path: Path, plan: LinearPlan) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # tensor-parallel ranks may write at once
    tmp.write_text(json.dumps({"choices": plan.choices, "timings_ms": plan.timings_ms, "took_s": plan.took_s,
                               "other_cores": plan.other_cores}))
    os.replace(tmp, path)


def choose_plan(model: nn.Module, setup: LinearSetup) -> LinearPlan:
    """The plan for ``model``'s linear layers: forced (``setup.backend`` names one), read from the
    machine's cache, or measured now and cached."""
    shapes = _layer_buckets(model, setup)
    if not shapes:
        return LinearPlan({})
    if setup.backend != "auto":
        choices, refused = {}, []
        for key, (weight, num_buckets) in shapes.items():
            bits = activation_bits_of(key)
            backend = next((b for b in (setup.backend, SAME_RESULT.get(setup.backend)) if b
                            and backend_supports(b, weight, bits)), fallback_backend(weight))
            choices[key] = [backend] * num_buckets
            if backend != setup.backend:
                refused.append((key, weight, backend))
        if refused:
            if setup.backend in INT8_BACKENDS and any(weight.dtype == torch.int8 for _, weight, _ in refused):
                hint = f" ({setup.backend} does not run the layers with 8-bit activations: --quantization int8's O and gate/up)"
            elif setup.backend in INT8_BACKENDS:
                hint = " (an int8 backend runs --quantization int8 / w8a16 layers only)"
            elif any(weight.dtype == torch.int8 for _, weight, _ in refused):
                hint = " (a float backend cannot run --quantization int8 / w8a16 layers)"
            elif setup.backend == "fp32_stream":
                hint = " (fp32_stream runs float32 weights only; fp32_cpu is the same kernel for bfloat16)"
            else:
                hint = ""
            log.warning("linear backend %s cannot run %d of %d weight shapes here%s; instead: %s",
                        setup.backend, len(refused), len(shapes), hint,
                        ", ".join(f"{key} {weight.dtype} on {weight.device} through {backend}"
                                  for key, weight, backend in refused))
        return LinearPlan(choices, forced=True)
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
    cached = _read_cached(path)
    if (cached is not None and set(cached.choices) == set(shapes)
            and all(len(cached.choices[key]) >= n for key, (_, n) in shapes.items())):
        # A plan measured on a busy machine is kept until a start finds the machine quiet.
        if cached.other_cores <= BUSY_OTHER_CORES or other_cores_now() > BUSY_OTHER_CORES:
            return _first_buckets(cached, shapes)
    plan = _measure_now(shapes)
    _write_cached(path, plan)
    return plan


def _first_buckets(plan: LinearPlan, shapes: dict[str, tuple[torch.Tensor, int]]) -> LinearPlan:
    """``plan`` cut to the buckets ``shapes`` asks for (a plan cached by an engine with a larger
    step budget or batch covers more)."""
    choices = {key: plan.choices[key][:n] for key, (_, n) in shapes.items()}
    timings = {key: {b: ms[:n] for b, ms in plan.timings_ms.get(key, {}).items()} for key, (_, n) in shapes.items()}
    return LinearPlan(choices, timings, plan.took_s, cached=plan.cached, other_cores=plan.other_cores)


def _measure_now(shapes: dict[str, tuple[torch.Tensor, int]]) -> LinearPlan:
    others = OtherCpuUse()
    plan = measure(shapes, BACKENDS)
    plan.other_cores = others.cores()
    if plan.other_cores > BUSY_OTHER_CORES:
        # Timings of a busy machine measure the other processes as much as the GEMMs.
        log.warning("linear backends measured while other processes kept %.2f cores busy: the first start on "
                    "a quiet machine measures them again", plan.other_cores)
    return plan


C_KERNELS = ("fp32_cpu", "fp32_stream")


def keep_layers_on_c_kernels(plan: LinearPlan, layer_keys: list[str], num_buckets: int) -> list[int]:
    """Where a decoder layer's GEMMs (``layer_keys``: its shape keys) on Tandem's C kernels are,
    together, within TIE_MARGIN of the ones chosen, moves the chosen ones to the C kernels, for
    each of the first ``num_buckets`` M buckets (the decode steps'). A decode pass whose GEMMs
    are all on the C kernels runs its layers as one C call (engine.kernels.cpu_decode_layers),
    which saves more than a GEMM's lead inside the margin: on a 2-core AMD EPYC (Zen 4) the
    bfloat16 down projection's oneDNN (0.118 ms at M = 16, against the C kernel's 0.112, a tie
    that the order gave to oneDNN) kept a batch-16 pass on the layer loop. Returns the buckets
    moved; mutates ``plan.choices``."""
    moved = []
    for b in range(num_buckets):
        chosen_ms = c_ms = 0.0
        picks = {}
        for key in layer_keys:
            times = plan.timings_ms.get(key, {})
            c_times = {m: times[m][b] for m in C_KERNELS if m in times and b < len(times[m]) and times[m][b]}
            chosen = plan.choices[key][b]
            if not c_times or chosen not in times or not times[chosen][b]:
                break
            picks[key] = min(c_times, key=c_times.get)
            chosen_ms, c_ms = chosen_ms + times[chosen][b], c_ms + c_times[picks[key]]
        else:
            if any(plan.choices[key][b] != pick for key, pick in picks.items()) and c_ms <= chosen_ms * (1 + TIE_MARGIN):
                for key, pick in picks.items():
                    plan.choices[key] = [*plan.choices[key][:b], pick, *plan.choices[key][b + 1:]]
                moved.append(b)
    return moved


def _decoder_layer_keys(model: nn.Module) -> list[str] | None:
    """The shape keys of a Llama model's decoder-layer GEMMs when its decode passes can run as one C
    call (engine.kernels.cpu_decode_layers), else None."""
    from engine.kernels.cpu_decode_layers import DecodeLayerStack

    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or DecodeLayerStack.for_model(inner) is None:
        return None
    first = inner.layers[0]
    gemms = (first.self_attn.qkv_proj, first.self_attn.o_proj, first.mlp.gate_up_proj, first.mlp.down_proj)
    return sorted({shape_key(g.gemm_weight, g.activation_bits) for g in gemms})


def plan_linears(model: nn.Module, setup: LinearSetup) -> LinearPlan:
    """Chooses (:func:`choose_plan`) and applies a backend plan to every :class:`Linear` of
    ``model``, logging one summary line. Mutates the layers (prepared weight copies)."""
    plan = choose_plan(model, setup)
    layer_keys = None if plan.forced or not plan.timings_ms else _decoder_layer_keys(model)
    if layer_keys is not None and all(key in plan.choices for key in layer_keys):
        plan.choices = {key: list(choice) for key, choice in plan.choices.items()}
        moved = keep_layers_on_c_kernels(plan, layer_keys, m_bucket(setup.max_num_seqs) + 1)
        if moved:
            log.info("decode M buckets %s: the layers' GEMMs kept on the C kernels (within %.0f %% together), so "
                     "those passes run as one C call", moved, TIE_MARGIN * 100)
    for layer in planned_layers(model):
        choice = plan.choices.get(shape_key(layer.gemm_weight, layer.activation_bits))
        if choice is None or set(choice) == {"torch"}:
            layer.clear_plan()
        else:
            layer.set_plan(tuple(choice))
    log.info("%s", plan.summary())
    return plan


__all__ = ["LinearPlan", "LinearSetup", "Linear", "choose_plan", "keep_layers_on_c_kernels", "plan_linears", "measure"]
