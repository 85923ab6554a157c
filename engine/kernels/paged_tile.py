"""The tile step both paged attention kernels share (a ``triton.jit`` function, inlined into each).

Online softmax in base 2 (FlashAttention-2, Dao 2023): a tile of keys at positions ``n`` is read
from the paged cache through the sequence's block table and folded into the running max ``m``,
normaliser ``l`` and accumulator ``acc`` of every query row.

An 8-bit cache (``KV_QUANT`` 1: int8, 2: float8 e4m3fn read as bytes) holds rows of ``HEAD_DIM``
values then their float32 scale (:mod:`engine.kv_cache.kv_quant`): a tile's values are widened to
float32, each key's scale multiplies its scores and each value's scale its softmax weights.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def fp8_bits_to_f32(x):
    """float8 e4m3fn bytes (uint8) -> float32 by bit arithmetic (as the C kernel): exponent
    re-biased 7 -> 127, mantissa moved up; a subnormal built as 2^-6 (1 + m/8), 2^-6 taken off."""
    w = x.to(tl.int32) & 0xFF
    sign = (w & 0x80) << 24
    sub = (w & 0x78) == 0
    bits = (((w & 0x7F) << 20) + (120 << 23) + tl.where(sub, 1 << 23, 0)) | sign
    corr = tl.where(sub, 0x3C800000 | sign, 0)
    return bits.to(tl.float32, bitcast=True) - corr.to(tl.float32, bitcast=True)


@triton.jit
def row_scales(base, slot, n_mask, HEAD_DIM: tl.constexpr):
    """[BLOCK_N] float32 scales of the rows at byte offsets ``slot`` from ``base`` (the 4 bytes
    after each row's values, little-endian, assembled from bytes: rows are only 4-byte aligned)."""
    b = tl.arange(0, 4)
    raw = tl.load(base + slot[:, None] + HEAD_DIM + b[None, :], mask=n_mask[:, None], other=0).to(tl.int32) & 0xFF
    bits = tl.sum(raw << (b * 8)[None, :], 1)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def attend_tile(
    q, m, l, acc,  # [R, BLOCK_D] queries; [R], [R], [R, BLOCK_D] float32 running state
    k_base, table_ptr,  # this KV head's K cache; the sequence's block-table row
    n, n_mask, valid, d, d_mask,  # key positions [BLOCK_N] and which exist; [R, BLOCK_N] scores kept
    stride_c_kv, stride_c_block, stride_c_slot, sm_scale_log2,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr, KV_QUANT: tl.constexpr = 0, HEAD_DIM: tl.constexpr = 0,
):
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
    slot = block.to(tl.int64) * stride_c_block + (n % BLOCK_SIZE) * stride_c_slot
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + slot[:, None] + d[None, :], mask=kv_mask, other=0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(k_base + stride_c_kv + slot[:, None] + d[None, :], mask=kv_mask, other=0)
    if KV_QUANT == 0:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [R, BLOCK_N]
    else:
        if KV_QUANT == 1:
            k, v = k.to(tl.float32), v.to(tl.float32)
        else:
            k, v = fp8_bits_to_f32(k), fp8_bits_to_f32(v)
        k_scale = row_scales(k_base, slot, n_mask, HEAD_DIM)
        v_scale = row_scales(k_base + stride_c_kv, slot, n_mask, HEAD_DIM)
        s = tl.dot(q.to(tl.float32), tl.trans(k), input_precision=PRECISION) * (k_scale * sm_scale_log2)[None, :]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    if KV_QUANT == 0:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    else:
        acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], v, input_precision=PRECISION)
    return m_new, l, acc
