"""8-bit KV cache (``--kv-cache-dtype fp8|int8``): the packed row layout and the readable
quantise / dequantise every backend is tested against.

An 8-bit cache keeps the float cache's shape with a longer last axis, in the 8-bit dtype::

    kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim + 4]
                                                                   └─ per (token, head) row:
    | q[0] q[1] ... q[head_dim-1] | scale (float32, 4 bytes) |       value[d] = q[d] * scale

``q`` is ``torch.float8_e4m3fn`` (``fp8``) or ``torch.int8`` (``int8``); the last four elements
of a row are the bytes of its float32 scale (``rows[..., head_dim:].view(torch.float32)``).
Symmetric, round to nearest: ``scale = max_d |x[d]| / QMAX`` (448 for e4m3, 127 for int8; an
all-zero row gets scale 1), ``q = round(x / scale)`` (int8: clamped to [-127, 127]; fp8: to
[-448, 448], then rounded to the nearest e4m3 value, ties to even).

Why per (token, head): a block fills token by token (decode writes one row per step), so a
row's scale is fixed when it is written and never requantised; a tensor-parallel rank's heads are
a slice of the head axis and carry their scales; and each row is scaled to its own range (the
round-trip error on SmolLM2-135M's K/V is measured in docs/quantization.md).
"""

from __future__ import annotations

import torch

from core.kv_cache_spec import KV_SCALE_BYTES

# Storage dtype and the largest magnitude a scaled value may take, per --kv-cache-dtype.
STORAGE_DTYPES = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}
SCALE_ELEMS = KV_SCALE_BYTES  # the scale's bytes are the row's last 4 one-byte elements


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether ``kv_cache`` (any slice of an engine cache) holds 8-bit rows with scales."""
    return kv_cache.dtype in QMAX


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The model's head_dim for a cache whose last axis is a head row (values, then the scale
    when quantized)."""
    return kv_cache.shape[-1] - SCALE_ELEMS if is_quantized(kv_cache) else kv_cache.shape[-1]


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache tensor's dtype for ``--kv-cache-dtype`` (``auto``: the model's).

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in STORAGE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of ('auto', 'fp8', 'int8'), got {kv_cache_dtype!r}")
    return STORAGE_DTYPES[kv_cache_dtype]


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """A zeroed engine KV cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, row]``
    of ``dtype`` on ``device``; ``row`` is ``head_dim``, or ``head_dim + 4`` for an 8-bit dtype."""
    row = head_dim + SCALE_ELEMS if dtype in QMAX else head_dim
    return torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, row), dtype=dtype, device=device)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Packed 8-bit rows of ``x``.

    Args:
        x: ``[..., head_dim]``, any float dtype (computed in float32).
        dtype: ``torch.float8_e4m3fn`` or ``torch.int8``.

    Returns:
        ``[..., head_dim + 4]`` of ``dtype``: the values, then each row's float32 scale's bytes.
    """
    qmax = QMAX[dtype]
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, one ulp
    # off IEEE division at times; the kernels (C, Triton) divide exactly.
    scale = torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))  # [..., 1], float32
    scaled = (x / scale).clamp(-qmax, qmax)
    q = scaled.round().to(torch.int8) if dtype == torch.int8 else scaled.to(dtype)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_ELEMS), dtype=torch.uint8, device=x.device)
    rows[..., : x.shape[-1]] = q.view(torch.uint8)
    rows[..., x.shape[-1]:] = scale.contiguous().view(torch.uint8)
    return rows.view(dtype)


def dequantize_rows(rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., head_dim + 4]`` packed rows -> ``[..., head_dim]`` of ``out_dtype`` (``q * scale``
    in float32, then cast)."""
    head_dim = rows.shape[-1] - SCALE_ELEMS
    scale = rows[..., head_dim:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].to(torch.float32) * scale).to(out_dtype)


def as_values(kv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as float values of ``out_dtype``: dequantised when ``kv`` is 8-bit, else ``kv``
    itself (no copy)."""
    return dequantize_rows(kv, out_dtype) if is_quantized(kv) else kv


def write_rows(rows: torch.Tensor, cache_plane: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters packed rows ``[num_tokens, num_kv_heads, head_dim + 4]`` into one layer's K (or
    V) plane ``[num_blocks, block_size, num_kv_heads, head_dim + 4]`` at ``slot_mapping``
    (``[num_tokens]`` int64). Mutates ``cache_plane``. Through uint8 views: ``index_copy_`` takes
    no float8."""
    num_kv_heads, row = cache_plane.shape[-2:]
    cache_plane.view(torch.uint8).view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, rows.view(torch.uint8))
