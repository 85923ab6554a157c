"""KV-cache write: scatter this step's K/V into the paged cache by slot (vLLM's
``reshape_and_cache``, PagedAttention, Kwon et al. SOSP'23).

Reference: :func:`engine.attention.write_kv`.

::

    key[t]   ──► kv_cache[0].view(-1, H_kv, D)[slot_mapping[t]]
    value[t] ──► kv_cache[1].view(-1, H_kv, D)[slot_mapping[t]]        (slot < 0: skipped)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check_launchable

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


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes ``key``/``value`` into ``kv_cache`` at ``slot_mapping``. Mutates ``kv_cache``.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, any strides.
        kv_cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; blocks and their
            slots must be addressable as one slot axis (true for any slice of a contiguous cache).
        slot_mapping: ``[num_tokens]`` int64 on the cache's device; negative slots are skipped.

    Raises:
        ValueError: shapes or dtypes that do not match the cache.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or kv_cache.shape[-2:] != (num_kv_heads, head_dim):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} do not fit cache {tuple(kv_cache.shape)}")
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype}/{value.dtype} differs from the cache's {kv_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} for {num_tokens} tokens")
    if kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache blocks must be laid out back to back (slice of a contiguous cache)")
    if num_tokens == 0:
        return
    check_launchable(_kv_cache_write_kernel, kv_cache)
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
