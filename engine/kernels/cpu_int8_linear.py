"""Linear layers with int8 weights on the CPU: a small C kernel (``cpu/int8_linear.c``) that
widens each int8 weight to float32 as it reads it (weight-only quantisation, dequantised in the
kernel), compiled once per machine (:mod:`engine.kernels.cpu_build`).

Where no compiler works, or the C source is not installed, :func:`load_kernel` logs a warning and
returns None, and the linear layers keep the torch backends (engine.model.linear).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from engine.kernels import cpu_build


SOURCE = Path(__file__).parent / "cpu" / "int8_linear.c"


def _declare(lib: ctypes.CDLL) -> None:
    lib.int8_linear_f32.restype = None
    lib.int8_linear_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    for name in ("int8_linear_panel_width", "int8_linear_pack_pairs", "int8_linear_packed_min_rows"):
        getattr(lib, name).restype = ctypes.c_int
        getattr(lib, name).argtypes = []
    lib.int8_linear_pack.restype = None
    lib.int8_linear_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.int8_linear_packed.restype = ctypes.c_int
    lib.int8_linear_packed.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.int8_linear_a8_available.restype = ctypes.c_int
    lib.int8_linear_a8_available.argtypes = []
    lib.int8_linear_a8_packed_bytes.restype = ctypes.c_int64
    lib.int8_linear_a8_packed_bytes.argtypes = [ctypes.c_int64] * 2
    lib.int8_linear_a8_pack.restype = None
    lib.int8_linear_a8_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
    lib.int8_linear_a8_packed.restype = ctypes.c_int
    lib.int8_linear_a8_packed.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    lib.int8_quantize_rows_u8.restype = None
    lib.int8_quantize_rows_u8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    lib.int8_split_rows_u8.restype = None
    lib.int8_split_rows_u8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU int8 linear kernel", "int8 layers use the torch backends", _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, compiling it first if needed; None (logged once) when it cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


def int8_linear_cpu(
    kernel: ctypes.CDLL,
    x: torch.Tensor,  # [M, K], float32
    qweight: torch.Tensor,  # [N, K], int8, contiguous
    scale: torch.Tensor,  # [N], float32, contiguous
    bias: torch.Tensor | None,  # [N], float32, contiguous
) -> torch.Tensor:  # [M, N], float32
    """``x @ (qweight * scale[:, None]).T + bias`` with float32 products and sums.

    The C code trusts what it is given, so every shape, dtype and layout is checked here (a
    mismatch would read past a tensor rather than fail).

    Raises:
        ValueError: a tensor with another dtype, device, layout or shape than the above.
    """
    if x.dtype != torch.float32 or qweight.dtype != torch.int8 or scale.dtype != torch.float32 \
            or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"float32 x, scale and bias with an int8 weight only, got x {x.dtype}, weight "
                         f"{qweight.dtype}, scale {scale.dtype}, bias {None if bias is None else bias.dtype}")
    if any(t.device.type != "cpu" for t in (x, qweight, scale)):
        raise ValueError("CPU tensors only")
    if x.dim() != 2 or qweight.dim() != 2 or x.shape[1] != qweight.shape[1] or scale.shape != qweight.shape[:1] \
            or (bias is not None and bias.shape != qweight.shape[:1]):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(qweight.shape)}, scale {tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit [M, K], [N, K], [N], [N]")
    if not (qweight.is_contiguous() and scale.is_contiguous() and (bias is None or bias.is_contiguous())):
        raise ValueError("weight, scale and bias must be contiguous")
    x = x.contiguous()
    (m, k), n = x.shape, qweight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    kernel.int8_linear_f32(x.data_ptr(), qweight.data_ptr(), scale.data_ptr(),
                           None if bias is None else bias.data_ptr(), out.data_ptr(), m, n, k,
                           torch.get_num_threads())
    return out


@functools.cache
def _build_constants(kernel: ctypes.CDLL) -> tuple[int, int, int]:
    """(panel width, k pairs side by side, packed path's fewest rows) of this build, asked of the
    library once: three ctypes calls on every GEMM were a tenth of a decode-sized call."""
    return (kernel.int8_linear_panel_width(), kernel.int8_linear_pack_pairs(),
            kernel.int8_linear_packed_min_rows())


def packed_path(kernel: ctypes.CDLL) -> bool:
    """Whether this machine's build has a packed path (:func:`pack_weight`,
    :func:`int8_linear_packed_cpu`): with AVX512-VNNI and AVX512-BW, VPDPWSSD on x rounded to int16
    (:func:`packed_rounds_activations`); with AVX2 + FMA only, float32 multiply-adds on the weight
    widened exactly as it is loaded, from :func:`packed_min_rows` rows on."""
    return _build_constants(kernel)[0] > 0


def packed_rounds_activations(kernel: ctypes.CDLL) -> bool:
    """Whether the packed path rounds each row of x to int16 (the VNNI build; its panels hold k
    pairs side by side) rather than computing in float32."""
    return packed_path(kernel) and _build_constants(kernel)[1] == 1


def packed_min_rows(kernel: ctypes.CDLL) -> int:
    """The fewest rows of x the packed path is for (1 with VNNI, 3 with AVX2: at 1-2 rows
    :func:`int8_linear_cpu` on the plain weight is as fast); 0 without a packed path."""
    return _build_constants(kernel)[2] if packed_path(kernel) else 0


def _panel_shape(kernel: ctypes.CDLL, n: int, k: int) -> tuple[int, int, int, int]:
    width, pairs, _ = _build_constants(kernel)
    if pairs:
        return -(-n // width), (k + 1) // 2, width, 2
    return -(-n // width), k, width, 1


def pack_weight(kernel: ctypes.CDLL, qweight: torch.Tensor) -> torch.Tensor:
    """qweight int8 [N, K] -> its panels for :func:`int8_linear_packed_cpu`, P the build's panel
    width: int8 ``[ceil(N / P), ceil(K / 2), P, 2]`` with VNNI (pairs of k side by side, zeros past
    N and K), else ``[ceil(N / P), K, P, 1]`` (zeros past N). A new tensor; ``qweight`` is not
    changed.

    Raises:
        ValueError: not a contiguous 2-D int8 CPU tensor, or no packed path on this build.
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.device.type != "cpu" \
            or not qweight.is_contiguous():
        raise ValueError(f"a contiguous 2-D int8 CPU weight only, got {qweight.dtype} {tuple(qweight.shape)}")
    if not packed_path(kernel):
        raise ValueError("this build has no packed int8 path (the CPU lacks AVX2 + FMA)")
    n, k = qweight.shape
    packed = torch.empty(_panel_shape(kernel, n, k), dtype=torch.int8)
    kernel.int8_linear_pack(qweight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def int8_linear_packed_cpu(
    kernel: ctypes.CDLL,
    x: torch.Tensor,  # [M, K], float32
    packed: torch.Tensor,  # pack_weight()'s panels of an int8 [N, K] weight
    num_out: int,  # N
    scale: torch.Tensor,  # [N], float32, contiguous
    bias: torch.Tensor | None,  # [N], float32, contiguous
) -> torch.Tensor:  # [M, N], float32
    """``x @ (qweight * scale[:, None]).T + bias`` on :func:`pack_weight`'s panels. With VNNI
    (VPDPWSSD) each row of ``x`` is quantised to int16 on the fly (symmetric per row; error at most
    ``max|x[m]| / (2 qmax)``, qmax 32767 down to 11010 at K = 1536: see ``cpu/int8_linear.c``),
    int32 sums, float32 scaling; with AVX2 the products and sums are float32 (as
    :func:`int8_linear_cpu`'s), for M >= :func:`packed_min_rows`.

    Raises:
        ValueError: a tensor with another dtype, device, layout or shape than the above.
        MemoryError: the kernel could not allocate its scratch.
    """
    if x.dim() != 2:
        raise ValueError(f"x {tuple(x.shape)} does not fit [M, K]")
    return bind_int8_linear_packed(kernel, packed, x.shape[1], num_out, scale, bias, x.dtype)(x)


def bind_int8_linear_packed(
    kernel: ctypes.CDLL,
    packed: torch.Tensor,  # pack_weight()'s panels of an int8 [N, K] weight
    in_features: int,  # K
    num_out: int,  # N
    scale: torch.Tensor,  # [N], float32, contiguous
    bias: torch.Tensor | None,  # [N], float32, contiguous
    x_dtype: torch.dtype = torch.float32,  # the input's: float32 only
) -> Callable[[torch.Tensor], torch.Tensor]:  # x [M, K] float32 -> [M, N] float32
    """:func:`int8_linear_packed_cpu` with the panels, scale and bias checked and bound once:
    ``x -> x @ (qweight * scale[:, None]).T + bias``, each call checking ``x`` alone (a decode
    step's ~120 GEMM calls spent ~5 us each re-checking the weight).

    Raises:
        ValueError: as :func:`int8_linear_packed_cpu`, here for the weight's tensors, at the call
            for x.
        MemoryError: at the call, as :func:`int8_linear_packed_cpu`.
    """
    if x_dtype != torch.float32 or packed.dtype != torch.int8 or scale.dtype != torch.float32 \
            or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"float32 x, scale and bias with packed int8 panels only, got x {x_dtype}, panels "
                         f"{packed.dtype}, scale {scale.dtype}, bias {None if bias is None else bias.dtype}")
    if packed.device.type != "cpu" or scale.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        raise ValueError("CPU tensors only")
    if packed.dim() != 4 or not packed_path(kernel) or tuple(packed.shape) != _panel_shape(kernel, num_out, in_features) \
            or scale.shape != (num_out,) or (bias is not None and bias.shape != (num_out,)):
        raise ValueError(f"x [M, {in_features}], panels {tuple(packed.shape)}, scale {tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit a [{num_out}, K] weight")
    if not (packed.is_contiguous() and scale.is_contiguous() and (bias is None or bias.is_contiguous())):
        raise ValueError("panels, scale and bias must be contiguous")
    return _bound_call(kernel.int8_linear_packed, packed, in_features, num_out, scale, bias, "int8 linear")


def _bound_call(gemm: Callable[..., int], packed: torch.Tensor, k: int, num_out: int, scale: torch.Tensor,
                bias: torch.Tensor | None, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x [M, k] float32 -> [M, num_out] float32`` through the C entry point ``gemm`` (the
    ``int8_linear_packed`` signature) on weight tensors already checked; checks x at each call.

    Raises (at the call):
        ValueError: x is not float32 [M, k] on the CPU.
        MemoryError: the kernel could not allocate its scratch.
    """
    def call(x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be float32 [M, {k}] on the CPU, got {x.dtype} {tuple(x.shape)} on {x.device}")
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, num_out, dtype=torch.float32)
        if gemm(x.data_ptr(), packed.data_ptr(), scale.data_ptr(), None if bias is None else bias.data_ptr(),
                out.data_ptr(), m, num_out, k, torch.get_num_threads()):
            raise MemoryError(f"{name}: no scratch for x {tuple(x.shape)}")
        return out
    return call


# The largest |value| a row is quantised to before it is split into two bytes (127 * 256 + 127).
SPLIT_QMAX = 32639


def split_rows_u8(kernel: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations at 16-bit precision as two 8-bit halves, for an 8-bit x 8-bit GEMM library
    (``int8_onednn`` in engine.model.linear). Each row is quantised symmetrically on its own scale
    ``s[m] = max|x[m]| / SPLIT_QMAX`` to ``v = round(x / s)``, and v is split into a high byte
    ``hi = round(v / 256)`` (halves up) and a low byte ``lo = v - 256 hi``, both stored plus 128.

    x float32 [M, K] -> (q uint8 [2M, K]: the high bytes of every row, then the low bytes; s
    float32 [M]). ``(256 (q[m] - 128) + (q[M + m] - 128)) * s[m]`` is x[m] within ``s[m] / 2``
    per value (1/65278 of the row's largest magnitude). A zero row, or one whose largest magnitude
    is below ~1e-34 (SPLIT_QMAX / float32's max), gets s = 0 and q = 128; a row holding a NaN or
    an infinity gets s = NaN (its GEMM outputs are NaN).

    Raises:
        ValueError: x is not a 2-D float32 CPU tensor.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"a 2-D float32 CPU tensor only, got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(2 * m, k, dtype=torch.uint8)
    s = torch.empty(m, dtype=torch.float32)
    kernel.int8_split_rows_u8(x.data_ptr(), q.data_ptr(), s.data_ptr(), m, k, torch.get_num_threads())
    return q, s


# W8A8 (8-bit activations, int8_linear.c "W8A8"): the largest K whose int32 sums cannot overflow.
A8_MAX_K = 66311


@functools.cache
def a8_available(kernel: ctypes.CDLL) -> bool:
    """Whether this build has the W8A8 kernel (VPDPBUSD: AVX512-VNNI and AVX512-BW)."""
    return bool(kernel.int8_linear_a8_available())


def pack_weight_a8(kernel: ctypes.CDLL, qweight: torch.Tensor) -> torch.Tensor:
    """qweight int8 [N, K] -> the W8A8 kernel's packed weight, int8 [B] (B from
    ``int8_linear_a8_packed_bytes``): panels ``[ceil(N / P)][ceil(K / 4)][P][4]`` (P the panel
    width, four k side by side, zeros past N and K) followed by each channel's ``128 sum_k w[n, k]``
    as int32 ``[ceil(N / P) P]``. A new tensor; ``qweight`` is not changed.

    Raises:
        ValueError: not a contiguous 2-D int8 CPU tensor, K > A8_MAX_K, or no W8A8 path here.
    """
    if qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.device.type != "cpu" \
            or not qweight.is_contiguous():
        raise ValueError(f"a contiguous 2-D int8 CPU weight only, got {qweight.dtype} {tuple(qweight.shape)}")
    if not a8_available(kernel):
        raise ValueError("this build has no W8A8 int8 path (the CPU lacks AVX512-VNNI)")
    n, k = qweight.shape
    if k > A8_MAX_K:
        raise ValueError(f"W8A8 takes K <= {A8_MAX_K} (int32 sums), got {k}")
    packed = torch.empty(kernel.int8_linear_a8_packed_bytes(n, k), dtype=torch.int8)
    kernel.int8_linear_a8_pack(qweight.data_ptr(), packed.data_ptr(), n, k)
    return packed


def bind_int8_linear_a8(
    kernel: ctypes.CDLL,
    packed: torch.Tensor,  # pack_weight_a8()'s bytes of an int8 [N, K] weight
    in_features: int,  # K
    num_out: int,  # N
    scale: torch.Tensor,  # [N], float32, contiguous
    bias: torch.Tensor | None,  # [N], float32, contiguous
) -> Callable[[torch.Tensor], torch.Tensor]:  # x [M, K] float32 -> [M, N] float32
    """``x -> q8(x) @ (qweight * scale[:, None]).T + bias``, the W8A8 GEMM: each row of x is
    quantised symmetrically to 8 bits on its own scale ``max|x[m]| / 127`` (round to nearest
    even; :func:`quantize_rows_8bit` is the same rounding in torch), u8 x s8 products summed in
    int32 (VPDPBUSD), float32 scaling. The weight's tensors are checked here, x at each call.

    Raises:
        ValueError: a tensor with another dtype, device, layout or shape than the above.
        MemoryError: at the call, the kernel could not allocate its scratch.
    """
    if packed.dtype != torch.int8 or scale.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError(f"float32 scale and bias with packed int8 bytes only, got bytes {packed.dtype}, scale "
                         f"{scale.dtype}, bias {None if bias is None else bias.dtype}")
    if packed.device.type != "cpu" or scale.device.type != "cpu" or (bias is not None and bias.device.type != "cpu"):
        raise ValueError("CPU tensors only")
    if not a8_available(kernel) or packed.dim() != 1 \
            or packed.numel() != kernel.int8_linear_a8_packed_bytes(num_out, in_features) \
            or scale.shape != (num_out,) or (bias is not None and bias.shape != (num_out,)):
        raise ValueError(f"packed bytes {tuple(packed.shape)}, scale {tuple(scale.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not fit a [{num_out}, {in_features}] weight")
    if not (packed.is_contiguous() and scale.is_contiguous() and (bias is None or bias.is_contiguous())):
        raise ValueError("packed bytes, scale and bias must be contiguous")
    return _bound_call(kernel.int8_linear_a8_packed, packed, in_features, num_out, scale, bias, "int8 W8A8 linear")


def quantize_rows_u8(kernel: ctypes.CDLL, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of x quantised to 8 bits as the W8A8 kernel does, for an 8-bit x 8-bit GEMM
    library (``int8_onednn`` on a W8A8 layer): ``s[m] = max|x[m]| / 127``, ``q = round(x / s) + 128``.

    x float32 [M, K] -> (q uint8 [M, K], s float32 [M]); ``(q[m] - 128) * s[m]`` is x[m] within
    ``s[m] / 2`` per value. A zero row (or one below ~1e-36) gets s = 0 and q = 128; a row holding
    a NaN or an infinity s = NaN.

    Raises:
        ValueError: x is not a 2-D float32 CPU tensor.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.device.type != "cpu":
        raise ValueError(f"a 2-D float32 CPU tensor only, got {x.dtype} {tuple(x.shape)} on {x.device}")
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8)
    s = torch.empty(m, dtype=torch.float32)
    kernel.int8_quantize_rows_u8(x.data_ptr(), q.data_ptr(), s.data_ptr(), m, k, torch.get_num_threads())
    return q, s


def quantize_rows_8bit(x: torch.Tensor) -> torch.Tensor:
    """The W8A8 kernels' activation rounding in torch (the reference, and ``int8_dequant`` on a
    W8A8 layer): each row of x [M, K] float32 to ``round(x / s) * s``, ``s = max|x[m]| / 127``
    (round to nearest even; a zero row stays zero). Returns a new float32 [M, K] tensor."""
    amax = x.abs().amax(dim=-1, keepdim=True)
    # 127 / amax as the kernels compute it (a float division; torch's scalar / tensor can be a
    # reciprocal times 127, one ulp off, which moves values sitting on a rounding tie).
    inv = torch.full_like(amax, 127.0) / amax
    q = torch.round(x * torch.where(amax > 0, inv, torch.zeros_like(amax)))
    return q * (amax / 127)
