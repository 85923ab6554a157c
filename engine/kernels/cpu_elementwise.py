"""The decoder layer's elementwise steps as one C call each on the CPU (``cpu/elementwise.c``):
RMSNorm, the rotary embedding (in place) and SiLU(gate) x up, float32 or bfloat16 (rounded where the
torch forms' bfloat16 ops round), and greedy sampling's argmax over float32 logits, compiled once
per machine (:mod:`engine.kernels.cpu_build`).

Eager torch runs each as 5-8 small ops, 18-50 µs per call on a decode step's few rows: ~4 ms of a
30-layer decode pass on a 2-core AMD EPYC, 10 % of the batch-1 pass (in bfloat16 each also
converts to float32 and back). engine.model.llama calls these for float32 and bfloat16 CPU tensors
outside ``torch.compile`` (:func:`usable`); CUDA, float16 and the compiled forward keep the torch
forms. Where no compiler works, :func:`load_kernel` logs a warning
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
    lib.argmax_rows_f32.restype = None
    lib.argmax_rows_f32.argtypes = [ptr, ptr, i64, i64, ctypes.c_int]
    for name in ("rms_norm", "rotary", "silu_mul"):
        f32, bf16 = getattr(lib, f"{name}_f32"), getattr(lib, f"{name}_bf16")
        bf16.restype, bf16.argtypes = f32.restype, f32.argtypes


DTYPES = (torch.float32, torch.bfloat16)


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU elementwise kernels", "the layers' elementwise steps run in torch",
                                 _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernels, compiling them first if needed; None (logged once) when they cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


def usable(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels when ``x`` can go through them (a float32 or bfloat16 CPU tensor, outside
    torch.compile and autograd), else None."""
    if torch.compiler.is_compiling() or x.dtype not in DTYPES or x.device.type != "cpu" or \
            (x.requires_grad and torch.is_grad_enabled()):
        return None
    return load_kernel()


def rms_norm(kernel: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` ([..., D] float32 or bfloat16) with ``weight`` ([D], x's dtype): a new
    tensor of x's shape and dtype.

    Raises:
        ValueError: another dtype, dtypes that differ, or a weight that is not [D].
    """
    if x.dtype not in DTYPES or weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"float32 or bfloat16 x [..., D] and weight [D] of its dtype only, got x {tuple(x.shape)} "
                         f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty_like(x)
    d = x.shape[-1]
    norm = kernel.rms_norm_f32 if x.dtype == torch.float32 else kernel.rms_norm_bf16
    norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // max(d, 1), d, eps,
                        torch.get_num_threads())
    return out


def rotary_(kernel: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates ``x`` ([T, H, D] float32 or bfloat16, heads contiguous, any token stride: a view
    into the fused QKV output) in place by ``cos`` / ``sin`` ([T, 1, D] or [T, D], x's dtype);
    returns ``x``.

    Raises:
        ValueError: another dtype, dtypes that differ, odd D, heads not laid out one after
            another, or tables of another shape.
    """
    if x.dtype not in DTYPES or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(f"float32 or bfloat16 x, cos and sin of one dtype only, got x {x.dtype}, cos {cos.dtype}, "
                         f"sin {sin.dtype}")
    if x.dim() != 3 or x.shape[-1] % 2 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        raise ValueError(f"x must be [T, H, D] with contiguous heads and even D, got shape {tuple(x.shape)} "
                         f"strides {x.stride()}")
    t, h, d = x.shape
    cos, sin = cos.reshape(-1, d).contiguous(), sin.reshape(-1, d).contiguous()
    if cos.shape[0] != t or sin.shape[0] != t:
        raise ValueError(f"cos / sin must hold one row of {d} per token ({t}), got {tuple(cos.shape)}")
    rotary = kernel.rotary_f32 if x.dtype == torch.float32 else kernel.rotary_bf16
    rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), t, h, d, x.stride(0), torch.get_num_threads())
    return x


def silu_mul(kernel: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused projection ``gate_up`` ([M, 2I] float32 or bfloat16:
    [gate | up]) -> [M, I], its dtype.

    Raises:
        ValueError: another dtype or shape.
    """
    if gate_up.dtype not in DTYPES or gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"float32 or bfloat16 [M, 2I] only, got {tuple(gate_up.shape)} {gate_up.dtype}")
    gate_up = gate_up.contiguous()
    m, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(m, i, dtype=gate_up.dtype)
    silu_mul = kernel.silu_mul_f32 if gate_up.dtype == torch.float32 else kernel.silu_mul_bf16
    silu_mul(gate_up.data_ptr(), out.data_ptr(), m, i, torch.get_num_threads())
    return out


def argmax_rows(kernel: ctypes.CDLL, x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, -1)`` of ``x`` ([M, N] float32, N >= 1) -> int64 [M]: the first index of
    each row's largest value, or of its first NaN (torch counts NaN as the largest).

    Raises:
        ValueError: another dtype or shape.
    """
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"float32 [M, N] with N >= 1 only, got {tuple(x.shape)} {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    kernel.argmax_rows_f32(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], torch.get_num_threads())
    return out
