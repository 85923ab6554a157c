"""Paged prefill / chunked-prefill attention, variable length, GQA-aware.

Sources: PagedAttention (vLLM, Kwon et al. SOSP'23) for reading K/V through a block table;
FlashAttention-2's tiling and online softmax (Dao 2023); the query-group packing of vLLM's
unified Triton attention (each KV tile serves every query head of its group).

Reference: the mixed-step path of ``TorchAttentionBackend.forward`` in :mod:`engine.attention`.

Sequences are packed without padding (``query_start_loc``). A sequence with ``q_len`` queries and
context ``ctx`` (cached tokens + this step's, already in the cache) has its queries at the end::

    keys:     0 ........................................ ctx-1
              |<-- cached (prefix hit / earlier chunks) -->|<-- this step's q_len -->|
    query j sits at position ctx - q_len + j and sees keys 0 .. ctx - q_len + j

One program serves one (sequence, KV head, query tile). Its ``BLOCK_M`` rows are
``BLOCK_M // G`` queries times the ``G`` query heads of the KV head (row ``r``: query
``r // G``, head ``r % G``), so a K/V tile is read once for the whole group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check_launchable, default_block_n, output_like

LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    sm_scale_log2,  # scale * log2(e): scores are kept in base 2
    stride_qt, stride_qh,  # query [T, H_q, D]; last dim contiguous
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h,  # cache [2, NB, BS, H_kv, D]
    stride_bt,  # block_tables row
    stride_ot, stride_oh,  # out [T, H_q, D]
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # queries per tile: BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # rows per tile, a power of two >= 16
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # keys per tile
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps fp32 exact, "tf32" otherwise
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = (tl.load(query_start_loc_ptr + seq + 1) - q_begin).to(tl.int32)
    if q_tile * BLOCK_Q >= q_len:
        return
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    q_idx = q_tile * BLOCK_Q + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    row_mask = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
    d_mask = d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    tokens = q_begin + q_idx.to(tl.int64)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    pos = ctx - q_len + q_idx  # absolute position of each row's query
    # Keys past the tile's last query are masked for every row: stop there.
    kv_end = tl.minimum(ctx, ctx - q_len + (q_tile + 1) * BLOCK_Q)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_c_h
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        block = tl.load(block_tables_ptr + seq.to(tl.int64) * stride_bt + n // BLOCK_SIZE, mask=n_mask, other=0)
        slot = block.to(tl.int64) * stride_c_block + (n % BLOCK_SIZE) * stride_c_slot
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(k_base + stride_c_kv + slot[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2  # [BLOCK_M, BLOCK_N]
        s = tl.where(n_mask[None, :] & (n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=io_mask,
    )


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    block_m: int = 64,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context. Returns
    ``[T, H_q, D]`` in the query's dtype: ``out`` when given (every row of a sequence in
    ``query_start_loc`` is written), else a new tensor.

    Args:
        query: ``[T, H_q, D]``, last dim contiguous; the cache's dtype.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, last dim contiguous, already holding
            this step's K/V.
        block_tables: ``[S, max_blocks]`` int64, same device (padding entries are never read).
        query_start_loc: ``[S + 1]`` int64, same device; ``query_start_loc[-1] == T``.
        seq_lens: ``[S]`` int64, same device: context length after this step, >= each ``q_len``.
        max_query_len: the longest ``q_len``; sizes the grid.
        scale: softmax scale, usually ``D ** -0.5``.
        block_m: rows per tile (queries x group heads), a power of two >= 16.
        block_n: keys per tile, a power of two >= 16; ``None``: 64, or 32 for rows of
            512+ bytes (fp32 with D=128) so the pipelined K/V tiles fit in shared memory.
        out: ``[T, H_q, D]`` like ``query``, last dim contiguous; mutated.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, mismatched head dims, or dtypes.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    if head_dim != cache_head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if query.dtype != kv_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {kv_cache.dtype}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last dimension")
    block_n = block_n or default_block_n(query)
    check_launchable(_prefill_kernel, kv_cache)
    out = output_like(out, query)
    num_seqs = seq_lens.numel()
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    _prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        query, kv_cache, block_tables, query_start_loc, seq_lens, out,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )
    return out
