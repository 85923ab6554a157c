"""KV-cache write: scatter this step's K/V into the paged cache by slot (vLLM's
``reshape_and_cache``, PagedAttention, Kwon et al. SOSP'23).

Reference: :func:`engine.attention.write_kv`.

::

    key[t]   ──► kv_cache[0].view(-1, H_kv, D)[slot_mapping[t]]
    value[t] ──► kv_cache[1].view(-1, H_kv, D)[slot_mapping[t]]        (slot < 0: skipped)

An 8-bit cache (float8 e4m3fn / int8, rows of ``D + 4``) gets each (token, head) row quantised
as :func:`engine.kv_cache.kv_quant.quantize_rows` does, byte for byte: one program per tile of
tokens and one KV head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check_launchable
from engine.kv_cache.kv_quant import head_dim_of, is_quantized

# Elements per program (tokens x heads x head_dim): big enough that the interpreter runs few
# programs, small enough to stay in registers on a GPU.
TILE_ELEMS = 4096


@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,  # key strides, elements
    stride_vt, stride_vh, stride_vd,  # value strides, elements
    stride_c_kv, stride_c_slot,  # cache: K/V plane, slot (block * block_size + offset)
    stride_c_h, stride_c_d,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    BLOCK_T: tl.constexpr,
    BLOCK_ROW: tl.constexpr,  # ROW rounded up to a power of two
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    i = tl.arange(0, BLOCK_ROW)
    h = i // HEAD_DIM
    d = i % HEAD_DIM
    mask = (slot >= 0)[:, None] & (i < ROW)[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + (h * stride_kh + d * stride_kd)[None, :], mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + (h * stride_vh + d * stride_vd)[None, :], mask=mask)
    dst = cache_ptr + slot[:, None] * stride_c_slot + (h * stride_c_h + d * stride_c_d)[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


@triton.jit
def _round_half_even(y):
    """Round to nearest, ties to even, for |y| < 2^22: adding and taking off 1.5 x 2^23 leaves
    float32's own rounding (torch.round's) to do it."""
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _f32_to_fp8_bits(y):
    """float32 (|y| <= 448) -> e4m3fn bits (int32 in [0, 255]), round to nearest even, as the C
    kernel and torch: subnormals (|y| < 2^-6) as round(|y| x 2^9), normals by rounding the
    mantissa at its bit 20 and re-biasing the exponent 127 -> 7."""
    b = y.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    ax = a.to(tl.float32, bitcast=True)
    small = _round_half_even(ax * 512.0).to(tl.int32)
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = tl.minimum((r >> 20) - (120 << 3), 0x7E)
    return tl.where(ax < 0.015625, small, normal) | sign


@triton.jit
def _quantize_store(x, dst, row_mask, d_mask, d, HEAD_DIM: tl.constexpr, FP8: tl.constexpr):
    """Quantises rows ``x`` [BLOCK_T, BLOCK_D] (float32) into packed rows at byte pointers ``dst``
    [BLOCK_T]: values, then the float32 scale's 4 bytes."""
    qmax = 448.0 if FP8 else 127.0
    amax = tl.max(tl.where(d_mask[None, :], tl.abs(x), 0.0), 1)
    # IEEE divisions (div_rn): CUDA's default float division is approximate, and one ulp there
    # would move a rounding tie away from the reference's bytes.
    scale = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, qmax, tl.float32)), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x)), -qmax), qmax)
    if FP8:
        q = _f32_to_fp8_bits(y)
    else:
        q = _round_half_even(y).to(tl.int32) & 0xFF
    tl.store(dst[:, None] + d[None, :], q.to(tl.uint8), mask=row_mask[:, None] & d_mask[None, :])
    b = tl.arange(0, 4)
    s_bits = (scale.to(tl.int32, bitcast=True)[:, None] >> (b * 8)[None, :]) & 0xFF
    tl.store(dst[:, None] + HEAD_DIM + b[None, :], s_bits.to(tl.uint8), mask=row_mask[:, None])


@triton.jit
def _kv_cache_write_q8_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,  # cache: uint8 bytes
    num_tokens,
    stride_kt, stride_kh, stride_kd,  # key strides, elements
    stride_vt, stride_vh, stride_vd,
    stride_c_kv, stride_c_slot, stride_c_h,  # cache strides, bytes
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    row_mask = slot >= 0
    mask = row_mask[:, None] & d_mask[None, :]
    t64 = t.to(tl.int64)[:, None]
    k = tl.load(key_ptr + t64 * stride_kt + h * stride_kh + d[None, :] * stride_kd, mask=mask, other=0.0)
    v = tl.load(value_ptr + t64 * stride_vt + h * stride_vh + d[None, :] * stride_vd, mask=mask, other=0.0)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_h
    _quantize_store(k.to(tl.float32), dst, row_mask, d_mask, d, HEAD_DIM, FP8)
    _quantize_store(v.to(tl.float32), dst + stride_c_kv, row_mask, d_mask, d, HEAD_DIM, FP8)


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes ``key``/``value`` into ``kv_cache`` at ``slot_mapping``. Mutates ``kv_cache``.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype (any float dtype
            for an 8-bit cache), any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, or 8-bit packed rows
            ``[..., head_dim + 4]``; blocks and their slots must be addressable as one slot axis
            (true for any slice of a contiguous cache).
        slot_mapping: ``[num_tokens]`` int64 on the cache's device; negative slots are skipped.

    Raises:
        ValueError: shapes or dtypes that do not match the cache.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    quantized = is_quantized(kv_cache)
    if value.shape != key.shape or (kv_cache.shape[-2], head_dim_of(kv_cache)) != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} do not fit cache {tuple(kv_cache.shape)}")
    if not quantized and (key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype):
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} differs from the cache's {kv_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be laid out back to back (slice of a contiguous cache)")
    if num_tokens == 0:
        return
    check_launchable(_kv_cache_write_kernel, kv_cache)
    if quantized:
        block_t = 16
        _kv_cache_write_q8_kernel[(triton.cdiv(num_tokens, block_t), num_kv_heads)](
            key, value, kv_cache.view(torch.uint8), slot_mapping,
            num_tokens,
            *key.stride(), *value.stride(),
            kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_T=block_t,
            FP8=kv_cache.dtype == torch.float8_e4m3fn,
        )
        return
    row = num_kv_heads * head_dim
    block_row = triton.next_power_of_2(row)
    block_t = max(1, min(16, TILE_ELEMS // block_row))
    _kv_cache_write_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, kv_cache, slot_mapping,
        num_tokens,
        *key.stride(), *value.stride(),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), kv_cache.stride(4),
        HEAD_DIM=head_dim, ROW=row, BLOCK_T=block_t, BLOCK_ROW=block_row,
    )
