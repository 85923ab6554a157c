"""Linear layers with int8 weights on the CPU: a small C kernel (``cpu/int8_linear.c``) that
widens each int8 weight to float32 as it reads it (weight-only quantisation, dequantised in the
kernel), compiled once per machine (:mod:`engine.kernels.cpu_build`).

Where no compiler works, or the C source is not installed, :func:`load_kernel` logs a warning and
returns None, and the linear layers keep the torch backends (engine.model.linear).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import cpu_build


SOURCE = Path(__file__).parent / "cpu" / "int8_linear.c"


def _declare(lib: ctypes.CDLL) -> None:
    lib.int8_linear_f32.restype = None
    lib.int8_linear_f32.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]


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
