"""The tile step both paged attention kernels share (a ``triton.jit`` function, inlined into each).

Online softmax in base 2 (FlashAttention-2, Dao 2023): a tile of keys at positions ``n`` is read
from the paged cache through the sequence's block table and folded into the running max ``m``,
normaliser ``l`` and accumulator ``acc`` of every query row.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_tile(
    q, m, l, acc,  # [R, BLOCK_D] queries; [R], [R], [R, BLOCK_D] float32 running state
    k_base, table_ptr,  # this KV head's K cache; the sequence's block-table row
    n, n_mask, valid, d, d_mask,  # key positions [BLOCK_N] and which exist; [R, BLOCK_N] scores kept
    stride_c_kv, stride_c_block, stride_c_slot, sm_scale_log2,
    BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
    slot = block.to(tl.int64) * stride_c_block + (n % BLOCK_SIZE) * stride_c_slot
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(k_base + stride_c_kv + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [R, BLOCK_N]
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc
