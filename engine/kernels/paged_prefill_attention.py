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

from engine.kernels import output_like, prepare_paged_launch, quant_launch
from engine.kernels.paged_tile import attend_tile

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
    KV_QUANT: tl.constexpr,  # 0: float K/V; 1: int8, 2: fp8 rows with a float32 scale each
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
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(0, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        causal = n_mask[None, :] & (n[None, :] <= pos[:, None])
        m, l, acc = attend_tile(q, m, l, acc, k_base, table_ptr, n, n_mask, causal, d, d_mask,
                                stride_c_kv, stride_c_block, stride_c_slot, sm_scale_log2, BLOCK_SIZE, PRECISION,
                                KV_QUANT, HEAD_DIM)

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
        query: ``[T, H_q, D]``, last dim contiguous; the cache's dtype (any float dtype for an
            8-bit cache).
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, last dim contiguous, already holding
            this step's K/V; or 8-bit (float8_e4m3fn / int8) packed rows ``[..., D + 4]``.
        block_tables: ``[S, max_blocks]`` int64, same device (padding entries are never read).
        query_start_loc: ``[S + 1]`` int64, same device; ``query_start_loc[-1] == T``.
        seq_lens: ``[S]`` int64, same device: context length after this step, >= each ``q_len``.
        max_query_len: the longest ``q_len``; sizes the grid.
        scale: softmax scale, usually ``D ** -0.5``.
        block_m: rows per tile (queries x group heads), a power of two >= 16.
        block_n: keys per tile, a power of two >= 16; ``None``: :func:`engine.kernels.default_block_n`.
        out: ``[T, H_q, D]`` like ``query``, last dim contiguous; mutated.

    Raises:
        ValueError, RuntimeError: as :func:`engine.kernels.prepare_paged_launch`.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    block_n = prepare_paged_launch(_prefill_kernel, query, kv_cache, block_n)
    kv_quant, kv_cache = quant_launch(kv_cache)
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
        PRECISION="ieee" if query.dtype == torch.float32 or kv_quant else "tf32", KV_QUANT=kv_quant,
    )
    return out
