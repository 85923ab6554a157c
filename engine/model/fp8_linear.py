"""float8 (e4m3) weights and activations for the linear layers: ``--quantization fp8``, for CUDA.

W8A8 in float8 e4m3 (``torch.float8_e4m3fn``: 4 exponent bits, 3 mantissa bits, largest finite
value 448), scaled the way FP8 serving engines commonly do it on Hopper and Ada GPUs (per output
channel for the weight, per token for the activation, both computed without calibration data):

- weight [out, in]: ``scale_w[n] = max_k |W[n, k]| / 448``, ``Wq = e4m3(W / scale_w[:, None])``,
  once at load (:func:`quantize_fp8`);
- activation [M, in]: ``scale_x[m] = max_k |x[m, k]| / 448``, ``xq = e4m3(x / scale_x[:, None])``,
  as each GEMM starts (:func:`quantize_rows_fp8`);
- ``y = (xq @ Wq.T) * scale_x[:, None] * scale_w[None, :] + bias``, summed in float32.

On CUDA the GEMM is ``torch._scaled_mm`` with row-wise scales (cuBLASLt's float8 GEMM: compute
capability 8.9 or later), its output in bfloat16 and then the activations' dtype. Elsewhere
:func:`fp8_linear` computes the same value from the dequantised operands with ``F.linear`` (the
reference the CPU tests check; torch's CPU ``_scaled_mm`` gives the same numbers but took 30-50 ms
per call on SmolLM2's shapes, and no CPU here has float8 arithmetic). ``e4m3`` rounds to nearest
even, so each element moves by at most 2^-4 of its own magnitude (normal range) or ``scale *
2^-10`` (subnormals).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value
# Scales never fall below this: a row of zeros quantises to zeros instead of 0/0.
_MIN_SCALE = 1e-12
# cuBLASLt's float8 GEMM wants K and N multiples of 16 (row-major A, column-major B).
CUDA_ALIGNMENT = 16
MIN_CUDA_CAPABILITY = (8, 9)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel float8 e4m3 quantisation: weight [out, in], any float dtype ->
    (qweight [out, in] ``float8_e4m3fn``, scale [out] float32), ``scale[n] = max|W[n]| / 448``."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_(min=_MIN_SCALE)
    return (w / scale[:, None]).to(FP8_DTYPE).contiguous(), scale.contiguous()


def dequantize_fp8(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """qweight [out, in] ``float8_e4m3fn``, scale [out] float32 -> the float32 weight they stand for."""
    return qweight.float() * scale[:, None]


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], any float dtype -> (xq [M, K] ``float8_e4m3fn``, scale [M, 1] float32), each row
    on its own scale ``max|x[m]| / 448``."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=_MIN_SCALE)
    return (x / scale).to(FP8_DTYPE), scale


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The float8 W8A8 GEMM (module docstring): x [..., in] (float32, bfloat16 or float16),
    qweight [out, in] ``float8_e4m3fn``, scale [out] float32, bias [out] or None -> [..., out] in
    x's dtype. ``torch._scaled_mm`` on CUDA, the dequantised reference elsewhere."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_rows_fp8(rows)
    if rows.is_cuda:
        out = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                               bias=None if bias is None else bias.to(torch.bfloat16), out_dtype=torch.bfloat16)
    else:
        out = F.linear(xq.float() * x_scale, dequantize_fp8(qweight, scale), None if bias is None else bias.float())
    return out.to(x.dtype).reshape(*shape[:-1], qweight.shape[0])


def check_cuda_fp8(device: torch.device | str, shapes: list[tuple[int, int]]) -> None:
    """Raises ValueError unless ``device`` is a CUDA GPU with float8 GEMMs (compute capability
    8.9 or later: Ada, Hopper, Blackwell) and every weight shape (out, in) is a multiple of 16
    both ways."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"fp8 weights run on CUDA GPUs with float8 GEMMs, not on {device.type!r}: "
                         "on a CPU use --quantization int8 or w8a16")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        raise ValueError(f"fp8 weights need a GPU of compute capability {MIN_CUDA_CAPABILITY[0]}."
                         f"{MIN_CUDA_CAPABILITY[1]} or later (Ada, Hopper); this one is {capability[0]}.{capability[1]}")
    odd = sorted({s for s in shapes if s[0] % CUDA_ALIGNMENT or s[1] % CUDA_ALIGNMENT})
    if odd:
        raise ValueError(f"fp8 GEMMs need weight dimensions that are multiples of {CUDA_ALIGNMENT}; "
                         f"this model has {odd[:3]}")
