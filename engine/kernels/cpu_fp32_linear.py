"""Linear layers on the CPU for decode's small M with float32 arithmetic: a register-blocked C
kernel (``cpu/fp32_linear.c``) on a weight packed once in panels of output channels, compiled once
per machine (:mod:`engine.kernels.cpu_build`) for its own ISA (AVX2 + FMA, or AVX-512). Float32
tensors, or bfloat16 ones (weight, input, bias and output): a bfloat16 weight is widened to float32
in registers as it is read, so it moves half the bytes of a float32 one and needs no AVX512-BF16;
where the CPU has AVX512-BF16 the weight is packed in pairs of k instead and VDPBF16PS multiplies
two pairs per lane (float32 sums of exact products, half the instructions);
where it also has AMX (and Linux grants the tiles), TDPBF16PS runs the same packed weight on the
tiles, 16 rows of x at a time (docs/engine.md).

It is one candidate of the linear chooser (backend ``fp32_cpu``, engine.model.linear): on a 2-core
AMD EPYC with AVX2 only it ran SmolLM2's GEMMs 1.2-1.9x faster than oneDNN at M = 1-8 and 1.2-1.5x
at M = 16 (docs/engine.md). Where no compiler works, or the C source is not installed,
:func:`load_kernel` logs a warning and returns None, and the chooser leaves the backend out.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "fp32_linear.c"


def _declare(lib: ctypes.CDLL) -> None:
    lib.fp32_linear_panel_width.restype = ctypes.c_int
    lib.fp32_linear_panel_width.argtypes = []
    lib.fp32_linear_pack.restype = None
    lib.fp32_linear_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.fp32_linear.restype = ctypes.c_int
    lib.fp32_linear.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.fp32_linear_stream.restype = ctypes.c_int
    lib.fp32_linear_stream.argtypes = lib.fp32_linear.argtypes
    lib.bf16_linear_pack.restype = None
    lib.bf16_linear_pack.argtypes = lib.fp32_linear_pack.argtypes
    lib.bf16_linear.restype = ctypes.c_int
    lib.bf16_linear.argtypes = lib.fp32_linear.argtypes
    lib.bf16_linear_pairs.restype = ctypes.c_int
    lib.bf16_linear_pairs.argtypes = []
    lib.panel_width = lib.fp32_linear_panel_width()  # read once: a ctypes call costs ~1 µs
    lib.bf16_pairs = bool(lib.bf16_linear_pairs())


DTYPES = (torch.float32, torch.bfloat16)


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU float32 linear kernel", "float32 layers use the library backends",
                                 _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, compiling it first if needed; None (logged once) when it cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


def pack_weight(kernel: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] float32 or bfloat16 (nn.Linear's layout) -> the kernel's packed copy
    [ceil(N / NR), K', NR] of the same dtype, NR output channels per panel (16 with AVX2, 32 with
    AVX-512), the last panel padded with zeros. K' is K, except for a bfloat16 weight on a CPU
    with AVX512-BF16: K rounded up to even, each panel's rows pairs of k ([K' / 2][NR][2]).

    Raises:
        ValueError: not a 2-D float32 or bfloat16 CPU tensor.
    """
    if weight.dim() != 2 or weight.dtype not in DTYPES or weight.device.type != "cpu":
        raise ValueError(f"a 2-D float32 or bfloat16 CPU weight only, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    weight = weight.detach().contiguous()
    n, k = weight.shape
    width = kernel.panel_width
    packed = torch.empty((n + width - 1) // width, packed_k(kernel, k, weight.dtype), width, dtype=weight.dtype)
    pack = kernel.fp32_linear_pack if weight.dtype == torch.float32 else kernel.bf16_linear_pack
    pack(weight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def packed_k(kernel: ctypes.CDLL, k: int, dtype: torch.dtype) -> int:
    """The packed weight's second dimension for a K of ``k`` (:func:`pack_weight`)."""
    return k + k % 2 if dtype == torch.bfloat16 and kernel.bf16_pairs else k


def fp32_linear_cpu(
    kernel: ctypes.CDLL,
    x: torch.Tensor,  # [M, K], float32 or bfloat16
    packed: torch.Tensor,  # [ceil(N / NR), K', NR], x's dtype, from pack_weight
    out_features: int,  # N
    bias: torch.Tensor | None,  # [N], x's dtype
    stream: bool = False,  # float32 only: the streaming schedule (same result, bit for bit)
) -> torch.Tensor:  # [M, N], x's dtype
    """``x @ weight.T + bias`` with float32 products and sums, ``weight`` as :func:`pack_weight`
    packed it. In bfloat16 each output is the float32 sum rounded once to bfloat16 (nearest even).

    The C code trusts what it is given, so every shape, dtype and layout is checked here (a
    mismatch would read past a tensor rather than fail).

    Raises:
        ValueError: a tensor with another dtype, device or shape than the above, a packed
            tensor that does not hold ``out_features`` channels of ``x``'s K, or ``stream``
            with bfloat16.
        MemoryError: the kernel could not allocate its scratch (M x K floats).
    """
    if x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit [M, K]")
    return bind_fp32_linear(kernel, packed, x.shape[1], out_features, bias, x.dtype, stream)(x)


def bind_fp32_linear(
    kernel: ctypes.CDLL,
    packed: torch.Tensor,  # [ceil(N / NR), K', NR], dtype, from pack_weight
    in_features: int,  # K
    out_features: int,  # N
    bias: torch.Tensor | None,  # [N], dtype
    dtype: torch.dtype,  # float32 or bfloat16: x's, the weight's, the output's
    stream: bool = False,  # float32 only: the streaming schedule (fp32_linear_stream; same result)
) -> Callable[[torch.Tensor], torch.Tensor]:  # x [M, K] -> [M, N], dtype
    """:func:`fp32_linear_cpu` with the weight and bias checked and bound once: ``x ->
    x @ weight.T + bias``, each call checking ``x`` alone (a decode step's ~120 GEMM calls spent
    ~5 us each re-checking the weight). The bound operands are used as they are now: a bias that
    was not contiguous is copied here.

    Raises:
        ValueError: as :func:`fp32_linear_cpu`, here for the weight and bias, at the call for x;
            ``stream`` with bfloat16.
        MemoryError: at the call, as :func:`fp32_linear_cpu`.
    """
    if dtype not in DTYPES or packed.dtype != dtype or (bias is not None and bias.dtype != dtype):
        raise ValueError(f"x, weight and bias all float32 or all bfloat16, got x {dtype}, weight {packed.dtype}, "
                         f"bias {None if bias is None else bias.dtype}")
    if packed.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        raise ValueError("CPU tensors only")
    width = kernel.panel_width
    if packed.dim() != 3 or packed.shape[2] != width or packed.shape[1] != packed_k(kernel, in_features, dtype) \
            or packed.shape[0] != (out_features + width - 1) // width \
            or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"x [M, {in_features}], packed weight {tuple(packed.shape)}, {out_features} output "
                         f"channels and bias {None if bias is None else tuple(bias.shape)} do not fit [M, K], "
                         f"[ceil(N / {width}), K, {width}], N and [N]")
    if not packed.is_contiguous():
        raise ValueError("the packed weight must be contiguous")
    bias = None if bias is None else bias.contiguous()
    if stream and dtype != torch.float32:
        raise ValueError(f"the streaming schedule runs float32 only, got {dtype}")
    linear = (kernel.fp32_linear_stream if stream else kernel.fp32_linear) if dtype == torch.float32 \
        else kernel.bf16_linear
    k, n = in_features, out_features

    def call(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != dtype or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be {dtype} [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, n, dtype=dtype)
        if m == 0:
            return out
        status = linear(x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                        out.data_ptr(), m, n, k, torch.get_num_threads())
        if status != 0:
            raise MemoryError(f"the linear kernel could not allocate {m * k * 4} bytes of scratch")
        return out
    return call
