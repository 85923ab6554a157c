"""The decoder layer's elementwise steps as one C call each on the CPU (``cpu/elementwise.c``):
RMSNorm, the rotary embedding (in place) and SiLU(gate) x up, float32, compiled once per machine
(:mod:`engine.kernels.cpu_build`).

Eager torch runs each as 5-8 small ops, 18-50 µs per call on a decode step's few rows: ~4 ms of a
30-layer decode pass on a 2-core AMD EPYC, 10 % of the batch-1 pass. engine.model.llama calls
these for float32 CPU tensors outside ``torch.compile`` (:func:`usable`); CUDA, bfloat16 and the
compiled forward keep the torch forms. Where no compiler works, :func:`load_kernel` logs a warning
and returns None, and the torch forms run.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import cpu_build

SOURCE = Path(__file__).parent / "cpu" / "elementwise.c"


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.rms_norm_f32.restype = None
    lib.rms_norm_f32.argtypes = [ptr, ptr, ptr, i64, i64, ctypes.c_float, ctypes.c_int]
    lib.rotary_f32.restype = None
    lib.rotary_f32.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ctypes.c_int]
    lib.silu_mul_f32.restype = None
    lib.silu_mul_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU elementwise kernels", "the layers' elementwise steps run in torch",
                                 _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernels, compiling them first if needed; None (logged once) when they cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


def usable(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels when ``x`` can go through them (a float32 CPU tensor, outside torch.compile
    and autograd), else None."""
    if torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu" or \
            (x.requires_grad and torch.is_grad_enabled()):
        return None
    return load_kernel()


def rms_norm(kernel: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ([..., D] float32) with ``weight`` ([D] float32): a new tensor of x's shape.

    Raises:
        ValueError: another dtype, or a weight that is not [D].
    """
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.shape != x.shape[-1:]:
        raise ValueError(f"float32 x [..., D] and weight [D] only, got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    kernel.rms_norm_f32(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(d, 1), d, eps,
                        torch.get_num_threads())
    return out


def rotary_(kernel: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ([T, H, D] float32, heads contiguous, any token stride: a view into the fused
    QKV output) in place by ``cos`` / ``sin`` ([T, 1, D] or [T, D] float32); returns ``x``.

    Raises:
        ValueError: another dtype, odd D, heads not laid out one after another, or tables of
            another shape.
    """
    if x.dtype != torch.float32 or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        raise ValueError(f"float32 only, got x {x.dtype}, cos {cos.dtype}, sin {sin.dtype}")
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"x must be [T, H, D] with contiguous heads and even D, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    t, h, d = x.shape
    cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    if cos.shape[0] != t or sin.shape[0] != t:
        raise ValueError(f"cos / sin must hold one row of {d} per token ({t}), got {tuple(cos.shape)}")
    kernel.rotary_f32(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, d, x.stride(0), torch.get_num_threads())
    return x


def silu_mul(kernel: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection ``gate_up`` ([M, 2I] float32: [gate | up]) ->
    [M, I].

    Raises:
        ValueError: another dtype or shape.
    """
    if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"float32 [M, 2I] only, got {tuple(gate_up.shape)} {gate_up.dtype}")
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=torch.float32)
    kernel.silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), m, i, torch.get_num_threads())
    return out
