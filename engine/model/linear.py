"""Linear layers whose GEMM backend is chosen per weight shape and per number of tokens.

``y = x @ weight.T + bias`` exactly as ``torch.nn.Linear``. A CPU model's layers can run their
GEMM through one of several backends (:data:`BACKENDS`), each with the weight prepared once in
the layout it reads fastest:

- ``onednn``: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) on a weight
  reordered once into oneDNN's blocked layout (``_reorder_linear_weight``). oneDNN keeps one
  primitive per input shape in its own LRU cache, so a given M is planned once. Float32, and
  bfloat16 where the CPU has AVX-512 (AVX512-BF16 / AMX kernels where it has them) or
  AVX-NE-CONVERT; an AVX2-only CPU runs bfloat16 through ``torch``.
- ``mkl``: MKL's packed sgemm (``cblas_sgemm_pack``), float32 only.
- ``torch``: plain ``F.linear`` (any dtype, any device).
- ``fp32_cpu``: Tandem's C kernel (engine.kernels.cpu_fp32_linear) with float32 arithmetic, the
  weight packed once in panels of output channels and read by a register-blocked micro-kernel:
  built for decode's small M, where the libraries' general kernels leave bandwidth or FMA
  throughput unused. Float32 or bfloat16 weights (a bfloat16 one widened as it is read, on any
  AVX2 CPU).
- ``fp32_stream``: the same kernel, weight layout and result (bit for bit) as ``fp32_cpu`` on
  another schedule, float32 only: each panel's K is cut into chunks that every row block runs
  over in turn, so the weight streams from DRAM at an even pace under the multiply-adds instead
  of being read in the first row block and reused from the caches by the later ones. Which
  schedule is faster depends on the CPU and M; a layer whose plan names both keeps one packed
  copy.

A layer quantised to int8 (:meth:`Linear.quantize_int8`, ``--quantization int8``) keeps an int8
weight [out, in] and one float32 scale per output channel, and runs through one of:

- ``int8_cpu``: Tandem's C kernel (engine.kernels.cpu_int8_linear): a quarter of the bytes of a
  float32 weight. Where the CPU has AVX512-VNNI the weight is packed once in panels and each
  activation row is quantised to int16 on the fly for VPDPWSSD (int32 sums, twice an FMA's
  multiply-adds per instruction; the row's error at most 1/(2 qmax) of its largest value, qmax
  32767 to 11010 at K <= 1536); elsewhere float32 activations, the int8 weight widened to float32
  as it is read (from 3 rows on, from panels packed once, by a 6 x 16 register-blocked kernel).
- ``int8_dequant``: ``F.linear`` on the weight dequantised to float32 at every call (the readable
  reference; fastest only where M is large enough to amortise the dequantisation).
- ``int8pack``: ``torch._weight_int8pack_mm`` (gpt-fast's weight-only int8 route), run with
  bfloat16 activations and scales (its float32 path measured 5-9x slower on an AVX2 EPYC): the
  activations lose float32's precision there, so it is behind the two above in the tie order.
- ``int8_onednn``: oneDNN's u8 x s8 inner product (``torch.ops.onednn.qlinear_pointwise``, the
  weight prepacked once by ``qlinear_prepack``), which runs on AMX tiles (TDPBUSD) where the CPU
  has ``amx_int8`` and on VPDPBUSD with AVX512-VNNI / AVX-VNNI; offered only on those CPUs. The
  activations keep 16-bit precision: each row of x is quantised on its own scale to 16 bits and
  split into a high and a low byte (:func:`engine.kernels.cpu_int8_linear.split_rows_u8`; error
  at most 1/65278 of the row's largest magnitude, as int8_cpu's VNNI path); one GEMM of the 2M
  byte rows gives each row's two exact int32 partial sums, combined as ``256 hi + lo`` and scaled
  by the row's scale, so a row's result does not depend on the other rows of the batch. (With
  the activations in one byte per row, W8A8, the AlpacaEval perplexity rose 3.3 % over float32's
  where the 16-bit activations cost 0.5 %.)

A layer quantised with ``activation_bits=8`` (W8A8: ``--quantization int8`` marks the attention
output and MLP gate/up projections, engine.model.loader) rounds each row of x to 8 bits on its own scale
``max|x[m]| / 127`` before the GEMM, whichever backend runs it, so its result is the GEMM of the
8-bit x with the int8 weight on every backend (up to the order of the sums): ``int8_cpu`` runs
VPDPBUSD on the bytes where the CPU has AVX512-VNNI (four multiply-adds per int32 lane, twice
VPDPWSSD's), elsewhere its float kernels on the rounded x; ``int8_onednn`` one u8 GEMM of the
rows; ``int8_dequant`` rounds in torch (:func:`engine.kernels.cpu_int8_linear.quantize_rows_8bit`).
``int8pack`` (bfloat16 activations) does not run them.

Which backend is fastest depends on the CPU, the weight's shape and M (the tokens in the step):
on a 2-core AMD EPYC (Zen 4) oneDNN ran the 49152 x 576 LM head 2-4x faster than MKL at every M
while on other CPUs MKL's packed GEMM can win at some M. :mod:`engine.model.linear_chooser`
measures the candidates on the model's real shapes and gives every layer a *plan*: one backend
per M bucket (:func:`m_bucket`). An unplanned layer behaves exactly like ``nn.Linear``.

Under ``torch.compile`` a planned layer is the opaque custom op ``tandem::planned_linear`` (the
dispatch by M happens inside it at run time, so one graph serves every M).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LINEAR_BACKEND_CHOICES
from engine.kernels.cpu_fp32_linear import bind_fp32_linear, pack_weight
from engine.kernels.cpu_fp32_linear import load_kernel as load_fp32_kernel
from engine.kernels import cpu_build
from engine.kernels.cpu_int8_linear import (a8_available, bind_int8_linear_a8, bind_int8_linear_packed,
                                            int8_linear_cpu, pack_weight_a8, packed_min_rows, packed_path,
                                            quantize_rows_8bit, quantize_rows_u8, split_rows_u8)
from engine.kernels.cpu_int8_linear import load_kernel as load_int8_kernel
from engine.kernels.cpu_int8_linear import pack_weight as pack_int8_weight
from engine.model.fp8_linear import fp8_linear, quantize_fp8

BACKENDS = LINEAR_BACKEND_CHOICES[1:]  # the tie order too (engine.model.linear_chooser.fastest)
FLOAT_BACKENDS = ("onednn", "mkl", "torch", "fp32_cpu", "fp32_stream")  # float32 / bfloat16 / float16 weights
INT8_BACKENDS = ("int8_cpu", "int8_dequant", "int8pack", "int8_onednn")  # int8 weights with float32 scales
assert BACKENDS == FLOAT_BACKENDS + INT8_BACKENDS
# The backends with a prepared weight copy, by their index in BACKENDS (planned_linear's arguments).
_ONEDNN, _MKL, _FP32_CPU, _FP32_STREAM, _INT8_CPU, _INT8_ONEDNN = (
    BACKENDS.index(b) for b in ("onednn", "mkl", "fp32_cpu", "fp32_stream", "int8_cpu", "int8_onednn"))
# Backends that run one kernel on one prepared weight and give the same result bit for bit: a
# plan naming several prepares the weight once (Linear.set_plan), and the chooser picks among them
# by time alone (engine.model.linear_chooser.fastest).
SAME_RESULT = {"fp32_stream": "fp32_cpu"}
# The /proc/cpuinfo flags of the int8 dot-product instructions oneDNN's u8 x s8 kernels need.
_INT8_DOT_FLAGS = frozenset({"amx_int8", "avx512_vnni", "avx_vnni"})
# The M (tokens) MKL tunes its packed layout for; any M is correct with it.
_MKL_BATCH_HINT = 16
# Activation precision of a quantised layer: 16 (rounded to int16 at most, as above) or 8 (W8A8).
ACTIVATION_BITS = (16, 8)


def m_bucket(num_tokens: int) -> int:
    """Index of the M bucket of ``num_tokens`` (>= 1): bucket b holds M in (2^(b-1), 2^b], so
    bucket 0 is M = 1, bucket 1 is M = 2, bucket 2 is M = 3..4, bucket 4 is M = 9..16, ..."""
    return (num_tokens - 1).bit_length()


def bucket_m(bucket: int) -> int:
    """The largest M of ``bucket`` (the M the chooser times it at)."""
    return 1 << bucket


def backend_supports(backend: str, weight: torch.Tensor, activation_bits: int = 16) -> bool:
    """Whether ``backend`` can run GEMMs with ``weight`` [out, in] (its device and dtype; an int8
    weight is a quantised layer's, with 8- or 16-bit activations)."""
    if backend not in BACKENDS:
        raise ValueError(f"linear backend must be one of {BACKENDS}, got {backend!r}")
    if (weight.dtype == torch.int8) != (backend in INT8_BACKENDS):
        return False
    if activation_bits == 8 and backend == "int8pack":  # bfloat16 activations
        return False
    if backend in ("torch", "int8_dequant"):
        return True
    if weight.device.type != "cpu":
        return False
    if backend == "mkl":
        return weight.dtype == torch.float32 and torch.backends.mkl.is_available()
    if backend == "onednn":
        if not torch.backends.mkldnn.is_available():
            return False
        # oneDNN's bfloat16 reorder refuses CPUs without AVX512BW/VL/DQ or AVX-NE-CONVERT (an AVX2
        # EPYC): F.linear runs bfloat16 there.
        return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and _onednn_bf16())
    if backend == "fp32_cpu":
        return weight.dtype in (torch.float32, torch.bfloat16) and load_fp32_kernel() is not None
    if backend == "fp32_stream":
        return weight.dtype == torch.float32 and load_fp32_kernel() is not None
    if backend == "int8_cpu":
        return load_int8_kernel() is not None
    if backend == "int8_onednn":
        return _onednn_int8() and load_int8_kernel() is not None
    return hasattr(torch, "_weight_int8pack_mm")  # int8pack


def fallback_backend(weight: torch.Tensor) -> str:
    """The backend that runs ``weight`` anywhere: ``torch`` (float) or ``int8_dequant`` (int8)."""
    return "int8_dequant" if weight.dtype == torch.int8 else "torch"


def _onednn_bf16() -> bool:
    """Whether oneDNN runs bfloat16 inner products on this CPU."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@functools.cache
def _onednn_int8() -> bool:
    """Whether oneDNN's u8 x s8 inner product is offered here: torch built with it, and a CPU with
    int8 dot products (AMX, AVX512-VNNI or AVX-VNNI). Without them oneDNN multiplies u8 by s8 with
    VPMADDUBSW, whose int16 sums of two products can saturate."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")):
        return False
    return bool(_INT8_DOT_FLAGS & set(cpu_build.cpu_flags().split()))


@functools.cache
def _zero_points(num_out: int) -> torch.Tensor:
    """int64 [num_out] zeros: the symmetric int8 weight's zero points, as qlinear_pointwise takes them."""
    return torch.zeros(num_out, dtype=torch.int64)


def prepare_weight(backend: str, weight: torch.Tensor, activation_bits: int = 16) -> torch.Tensor | None:
    """``weight`` [out, in] in ``backend``'s layout (None: the backend reads it as it is)."""
    weight = weight.detach()
    if backend == "int8_cpu" and activation_bits == 8 and a8_available(load_int8_kernel()):
        return pack_weight_a8(load_int8_kernel(), weight)
    if backend == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_BATCH_HINT)
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    if backend in ("fp32_cpu", "fp32_stream"):
        return pack_weight(load_fp32_kernel(), weight)
    if backend == "int8_cpu" and packed_path(load_int8_kernel()):
        return pack_int8_weight(load_int8_kernel(), weight)
    if backend == "int8_onednn":
        return torch.ops.onednn.qlinear_prepack(weight, None)
    return None


def run_backend(backend: str, x: torch.Tensor, prepared: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None, scale: torch.Tensor | None = None, activation_bits: int = 16) -> torch.Tensor:
    """``x`` [M, in] through ``backend`` with its prepared weight -> [M, out], x's dtype. An int8
    backend's ``weight`` is int8 [out, in] and ``scale`` its float32 [out] per-channel scales;
    ``activation_bits`` 8 rounds each row of x to 8 bits first (W8A8, module docstring)."""
    if backend in _BINDABLE or activation_bits == 8:
        return bind_backend(backend, prepared, weight, bias, scale, activation_bits)(x)
    if backend in INT8_BACKENDS:
        return _run_int8(backend, x, prepared, weight, scale, bias)
    if backend == "mkl":
        return torch.ops.mkl._mkl_linear(x, prepared, weight, bias, _MKL_BATCH_HINT)
    return F.linear(x, weight, bias)


@functools.cache
def _packed_min_rows() -> int:
    """From how many rows int8_cpu takes its packed path on this build (the kernel is loaded
    already wherever a layer has packed panels)."""
    return packed_min_rows(load_int8_kernel())


def _run_int8(backend: str, x: torch.Tensor, prepared: torch.Tensor | None, qweight: torch.Tensor,
              scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if backend == "int8_onednn":
        # x_scale 1, zero point 128: row r of the result is scale[n] * sum_k (q[r, k] - 128) w[n, k],
        # the high bytes' partial sums in rows 0..M, the low bytes' in M..2M.
        m = x.shape[0]
        q, s = split_rows_u8(load_int8_kernel(), x)
        both = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, prepared, scale, _zero_points(qweight.shape[0]), None,
                                                  1.0, 0, torch.float32, "none", [], "")
        out = both[:m].mul_(256.0).add_(both[m:]).mul_(s[:, None])
        return out if bias is None else out.add_(bias)
    if backend == "int8pack":
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16), qweight, scale.to(torch.bfloat16)).to(x.dtype)
        return out if bias is None else out + bias
    return F.linear(x, dequantize_int8(qweight, scale).to(x.dtype), bias)  # int8_dequant


# The backends whose per-call work bind_backend does once (run_backend binds them per call).
_BINDABLE = ("int8_cpu", "fp32_cpu", "fp32_stream", "onednn")


def bind_backend(backend: str, prepared: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                 scale: torch.Tensor | None = None, activation_bits: int = 16) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x -> run_backend(backend, x, prepared, weight, bias, scale, activation_bits)`` (x [M, in] -> [M, out]) with
    what can be looked up or checked once bound: the kernel library, the op, the packed path's row
    threshold, the weight's shapes. A decode step makes ~120 GEMM calls of 30-80 us, and that work
    took ~8 us of each when done per call.

    Raises:
        ValueError: a prepared weight, bias or scale the backend's kernel cannot take (the C
            backends check them here; x is checked at each call); ``activation_bits`` 8 on a
            backend that does not run W8A8 layers (backend_supports).
    """
    if activation_bits == 8:
        return _bind_w8a8(backend, prepared, weight, bias, scale)
    if backend == "int8_cpu":
        kernel = load_int8_kernel()
        if prepared is None:  # a build without the packed path
            return lambda x: int8_linear_cpu(kernel, x, weight, scale, bias)
        min_rows = _packed_min_rows()
        packed = bind_int8_linear_packed(kernel, prepared, weight.shape[1], weight.shape[0], scale, bias)

        def int8_packed(x: torch.Tensor) -> torch.Tensor:
            if x.shape[0] >= min_rows:
                return packed(x)
            return int8_linear_cpu(kernel, x, weight, scale, bias)
        return int8_packed
    if backend in ("fp32_cpu", "fp32_stream"):
        return bind_fp32_linear(load_fp32_kernel(), prepared, weight.shape[1], weight.shape[0], bias, weight.dtype,
                                stream=backend == "fp32_stream")
    if backend == "onednn":
        op = torch.ops.mkldnn._linear_pointwise
        return lambda x: op(x, prepared, bias, "none", [], "")
    return functools.partial(run_backend, backend, prepared=prepared, weight=weight, bias=bias, scale=scale)


def _bind_w8a8(backend: str, prepared: torch.Tensor | None, qweight: torch.Tensor, bias: torch.Tensor | None,
               scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """bind_backend for a W8A8 layer: x [M, in] float32 rounded to 8 bits per row, then the GEMM."""
    if backend == "int8_cpu" and prepared is not None and prepared.dim() == 1:  # the VPDPBUSD kernel's bytes
        return bind_int8_linear_a8(load_int8_kernel(), prepared, qweight.shape[1], qweight.shape[0], scale, bias)
    if backend == "int8_onednn":
        kernel, zero_points = load_int8_kernel(), _zero_points(qweight.shape[0])

        def onednn_u8(x: torch.Tensor) -> torch.Tensor:
            q, s = quantize_rows_u8(kernel, x)
            out = torch.ops.onednn.qlinear_pointwise(q, 1.0, 128, prepared, scale, zero_points, None, 1.0, 0,
                                                     torch.float32, "none", [], "").mul_(s[:, None])
            return out if bias is None else out.add_(bias)
        return onednn_u8
    if backend in ("int8_cpu", "int8_dequant"):  # the float kernels on the rounded x
        gemm = bind_backend(backend, prepared, qweight, bias, scale)
        return lambda x: gemm(quantize_rows_8bit(x))
    raise ValueError(f"linear backend {backend!r} does not run W8A8 layers (8-bit activations)")


# Symmetric int8: [-127, 127], so that -w quantises to -q (no -128).
INT8_MAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 quantisation (round to nearest):
    ``scale[n] = max_k |weight[n, k]| / 127``, ``qweight = round(weight / scale[:, None])``.

    weight [out, in], any float dtype -> (qweight [out, in] int8, scale [out] float32). A row of
    zeros gets scale 1 (and zeros). Each element's error is at most ``scale[n] / 2``.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    qweight = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return qweight.contiguous(), scale.contiguous()


def dequantize_int8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """qweight [out, in] int8, scale [out] float32 -> the float32 weight [out, in] they stand for."""
    return qweight.float() * scale[:, None]


_plan_version = 0  # plan_version(): bumped by every Linear.set_plan / clear_plan


def _bump_plan_version() -> None:
    global _plan_version
    _plan_version += 1


class Linear(nn.Module):
    """``nn.Linear``'s parameters (``weight`` [out, in], ``bias`` [out] or None) and result.

    ``forward(x [num_tokens, in]) -> [num_tokens, out]``, x's dtype. After :meth:`set_plan`, a
    2-D input of the weight's dtype runs through the backend its M bucket names. After
    :meth:`quantize_int8` the layer holds ``qweight`` (int8 [out, in]) and ``weight_scale``
    (float32 [out]) instead of ``weight`` and runs the int8 backends (float32 input and output).
    After :meth:`quantize_fp8` it holds ``fp8_weight`` (``float8_e4m3fn`` [out, in]) and
    ``weight_scale`` and runs :func:`engine.model.fp8_linear.fp8_linear` (x's dtype in and out).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # plan[b]: index into BACKENDS of M bucket b's backend; M past the last bucket uses it.
        self.plan: tuple[int, ...] | None = None
        # prepared[i]: BACKENDS[i]'s copy of the weight (plain tensors, not parameters).
        self.prepared: list[torch.Tensor | None] = [None] * len(BACKENDS)
        # bound[b]: M bucket b's backend with its prepared weight bound (bind_backend), and the
        # input dtype it takes; eager calls only (torch.compile traces planned_linear instead).
        self._bound: list[Callable[[torch.Tensor], torch.Tensor]] | None = None
        self._bound_dtype: torch.dtype | None = None
        self.register_buffer("qweight", None)  # int8 [out, in] once quantised
        self.register_buffer("weight_scale", None)  # float32 [out] once quantised
        self.register_buffer("fp8_weight", None)  # float8_e4m3fn [out, in] once quantised to fp8
        self.activation_bits = 16  # once quantised: 8 rounds x to 8 bits per row (W8A8)

    @property
    def gemm_weight(self) -> torch.Tensor:
        """The weight the GEMM reads: ``qweight`` (int8) or ``fp8_weight`` once quantised, else ``weight``."""
        if self.fp8_weight is not None:
            return self.fp8_weight
        return self.weight if self.qweight is None else self.qweight

    def quantize_int8(self, activation_bits: int = 16) -> None:
        """Replaces ``weight`` by its per-channel int8 quantisation (:func:`quantize_int8`) and
        clears the plan (a quantised layer without one runs ``int8_dequant``). ``activation_bits``
        8 makes it W8A8: each row of x is rounded to 8 bits before the GEMM (module docstring).
        Mutates this layer; a weight shared with another module (a tied LM head's embedding)
        stays float there.

        Raises:
            ValueError: the weight is not float32 (int8 layers take float32 activations), or
                ``activation_bits`` is not one of ACTIVATION_BITS.
        """
        if self.weight.dtype != torch.float32:
            raise ValueError(f"int8 quantisation needs a float32 weight, got {self.weight.dtype}")
        if activation_bits not in ACTIVATION_BITS:
            raise ValueError(f"activation_bits must be one of {ACTIVATION_BITS}, got {activation_bits!r}")
        self.activation_bits = activation_bits
        qweight, scale = quantize_int8(self.weight)
        self.weight = None
        self.qweight, self.weight_scale = qweight, scale
        self.clear_plan()

    def quantize_fp8(self) -> None:
        """Replaces ``weight`` by its per-channel float8 e4m3 quantisation
        (:func:`engine.model.fp8_linear.quantize_fp8`); each GEMM then rounds its input rows to
        float8 too (W8A8, ``--quantization fp8``). Clears the plan: no CPU backend runs float8.
        Mutates this layer; a weight shared with another module stays float there."""
        self.fp8_weight, self.weight_scale = quantize_fp8(self.weight)
        self.weight = None
        self.clear_plan()

    def set_plan(self, plan: tuple[str, ...], weight: torch.Tensor | None = None) -> None:
        """Runs M bucket ``b`` through backend ``plan[b]``, preparing ``weight`` (default: this
        layer's; the tied LM head passes the embedding's) once for every backend named. Mutates
        this layer.

        Raises:
            ValueError: an unknown backend, or one that cannot run this weight's dtype/device.
        """
        weight = (self.gemm_weight if weight is None else weight).detach()
        prepared: list[torch.Tensor | None] = [None] * len(BACKENDS)
        bits = self.activation_bits
        for name in sorted(set(plan), key=lambda b: b in SAME_RESULT):  # a shared copy's owner first
            if name not in BACKENDS or not backend_supports(name, weight, bits):
                raise ValueError(f"linear backend {name!r} cannot run a {weight.dtype} weight on {weight.device}"
                                 + (" with 8-bit activations" if bits == 8 else ""))
            shared = prepared[BACKENDS.index(SAME_RESULT[name])] if name in SAME_RESULT else None
            prepared[BACKENDS.index(name)] = shared if shared is not None else prepare_weight(name, weight, bits)
        self._source = weight  # the weight the plan was prepared from (MKL reads its shape)
        self.prepared = prepared
        self.plan = tuple(BACKENDS.index(name) for name in plan)
        bound = {name: bind_backend(name, prepared[BACKENDS.index(name)], weight, self.bias, self.weight_scale, bits)
                 for name in set(plan)}
        self._bound = [bound[name] for name in plan]
        self._bound_dtype = torch.float32 if self.qweight is not None else weight.dtype
        _bump_plan_version()

    def clear_plan(self) -> None:
        """Back to plain ``F.linear``; frees the prepared copies. Mutates this layer."""
        self.plan, self.prepared = None, [None] * len(BACKENDS)
        self._bound = self._bound_dtype = None
        _bump_plan_version()

    def backend_for(self, num_tokens: int) -> str:
        """The backend an input of ``num_tokens`` rows runs through."""
        if self.plan is None:
            return "torch"
        return BACKENDS[self.plan[min(m_bucket(num_tokens), len(self.plan) - 1)]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self._bound
        if bound is not None and x.dim() == 2 and x.dtype == self._bound_dtype \
                and not torch.compiler.is_compiling():
            return bound[min(m_bucket(x.shape[0]), len(bound) - 1)](x)
        if self.qweight is not None:
            return self._forward_int8(x)
        if self.fp8_weight is not None:
            return fp8_linear(x, self.fp8_weight, self.weight_scale, self.bias)
        if self.plan is None or x.dim() != 2 or x.dtype != self._source.dtype:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            cpu_weight = self.prepared[_FP32_CPU] if self.prepared[_FP32_CPU] is not None \
                else self.prepared[_FP32_STREAM]
            return planned_linear(x, self._source, self.bias, None, self.prepared[_ONEDNN],
                                  self.prepared[_MKL], cpu_weight, list(self.plan))
        code = self.plan[min(m_bucket(x.shape[0]), len(self.plan) - 1)]
        return run_backend(BACKENDS[code], x, self.prepared[code], self._source, self.bias)

    def _forward_int8(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        bits = self.activation_bits
        if self.plan is None:
            out = run_backend("int8_dequant", x, None, self.qweight, self.bias, self.weight_scale, bits)
        elif torch.compiler.is_compiling():
            out = planned_linear(x, self.qweight, self.bias, self.weight_scale, self.prepared[_INT8_ONEDNN], None,
                                 self.prepared[_INT8_CPU], list(self.plan), bits)
        else:
            code = self.plan[min(m_bucket(x.shape[0]), len(self.plan) - 1)]
            out = run_backend(BACKENDS[code], x, self.prepared[code], self.qweight, self.bias, self.weight_scale, bits)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        plan = "none" if self.plan is None else ",".join(BACKENDS[c] for c in self.plan)
        quantized = ", fp8" if self.fp8_weight is not None else "" if self.qweight is None \
            else ", int8 w8a16" if self.activation_bits == 16 else ", int8 w8a8"
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}{quantized}, plan={plan}"


@torch.library.custom_op("tandem::planned_linear", mutates_args=())
def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                   onednn_weight: torch.Tensor | None, mkl_weight: torch.Tensor | None,
                   cpu_weight: torch.Tensor | None, plan: list[int], activation_bits: int = 16) -> torch.Tensor:
    """A planned :class:`Linear` as one opaque op for ``torch.compile``: x [M, in] -> [M, out]
    (``weight`` int8 with its ``scale`` for a quantised layer; ``*_weight`` the prepared copies of
    onednn (int8_onednn's for a quantised layer), mkl and, in ``cpu_weight``, fp32_cpu's and
    fp32_stream's (a float layer's: one packed copy) or int8_cpu's (a quantised one's);
    ``activation_bits`` 8 for a W8A8 layer)."""
    code = plan[min(m_bucket(x.shape[0]), len(plan) - 1)]
    prepared = {_ONEDNN: onednn_weight, _MKL: mkl_weight, _FP32_CPU: cpu_weight, _FP32_STREAM: cpu_weight,
                _INT8_CPU: cpu_weight, _INT8_ONEDNN: onednn_weight}.get(code)
    return run_backend(BACKENDS[code], x, prepared, weight, bias, scale, activation_bits)


@planned_linear.register_fake
def _(x, weight, bias, scale, onednn_weight, mkl_weight, cpu_weight, plan, activation_bits=16):
    return x.new_empty(x.shape[0], weight.shape[0])


def plan_version() -> int:
    """A number that changes whenever any layer's plan is set or cleared (what caches of the plans,
    engine.kernels.cpu_decode_layers, compare)."""
    return _plan_version


def planned_layers(model: nn.Module) -> list[Linear]:
    """Every :class:`Linear` of ``model``, in module order."""
    return [module for module in model.modules() if isinstance(module, Linear)]
