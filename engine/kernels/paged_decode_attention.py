"""Paged decode attention, GQA-aware, with optional split-KV.

Sources: PagedAttention (vLLM, Kwon et al. SOSP'23) for reading K/V through a block table;
FlashAttention-2's online softmax (Dao 2023); Flash-Decoding (Dao et al. 2023) for splitting a
long context over several programs and merging their partial results by log-sum-exp.

Reference: ``TorchAttentionBackend._decode`` in :mod:`engine.attention`.

One program serves one (sequence, KV head, split): the ``G = H_q / H_kv`` query heads that share
the KV head are the rows of one ``[G, D] x [D, BLOCK_N]`` product, so each K/V tile is read once
for the whole group. Context tiles of ``BLOCK_N`` tokens gather slots through the block table::

    token n ─► block_tables[seq, n // block_size] * block_size + n % block_size

With ``num_splits > 1`` split ``s`` covers tokens ``[s * split_len, (s + 1) * split_len)`` and
writes a partial output and its log-sum-exp; a second kernel merges the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import output_like, prepare_paged_launch, quant_launch
from engine.kernels.paged_tile import attend_tile

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    sm_scale_log2,  # scale * log2(e): scores are kept in base 2
    stride_qs, stride_qh,  # query [S, H_q, D]; last dim contiguous
    stride_c_kv, stride_c_block, stride_c_slot, stride_c_h,  # cache [2, NB, BS, H_kv, D]
    stride_bt,  # block_tables row
    stride_os, stride_oh, stride_osplit,  # out [S, H_q, num_splits, D]
    split_len,  # tokens per split, a multiple of BLOCK_N
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_N: tl.constexpr,  # context tokens per tile
    PRECISION: tl.constexpr,  # tl.dot input precision: "ieee" keeps fp32 exact, "tf32" otherwise
    WRITE_LSE: tl.constexpr,  # split-KV: the merge kernel needs each split's log-sum-exp
    KV_QUANT: tl.constexpr,  # 0: float K/V; 1: int8, 2: fp8 rows with a float32 scale each
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=g_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_G, BLOCK_D]

    # Finite start value: a split with no token leaves m finite and l == 0 instead of NaN.
    m = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_c_h
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        m, l, acc = attend_tile(q, m, l, acc, k_base, table_ptr, n, n_mask, n_mask[None, :], d, d_mask,
                                stride_c_kv, stride_c_block, stride_c_slot, sm_scale_log2, BLOCK_SIZE, PRECISION,
                                KV_QUANT, HEAD_DIM)

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    out_off = seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + split * stride_osplit + d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if WRITE_LSE:  # lse [S, H_q, num_splits], base 2
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        num_heads = tl.num_programs(1) * GROUP
        tl.store(lse_ptr + (seq.to(tl.int64) * num_heads + heads) * tl.num_programs(2) + split, lse, mask=g_mask)


@triton.jit
def _merge_kernel(
    partial_ptr, lse_ptr, out_ptr,
    num_splits,
    stride_ps, stride_ph, stride_psplit,  # partial [S, H_q, num_splits, D], fp32
    stride_os, stride_oh,  # out [S, H_q, D]
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    sp_mask = sp < num_splits
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    lse = tl.load(lse_ptr + row * num_splits + sp, mask=sp_mask, other=float("-inf"))  # base 2
    w = tl.exp2(lse - tl.max(lse, 0))  # empty splits weigh 0; split 0 is never empty
    w = w / tl.sum(w, 0)
    part = tl.load(
        partial_ptr + seq.to(tl.int64) * stride_ps + head * stride_ph + sp[:, None] * stride_psplit + d[None, :],
        mask=sp_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    out_off = seq.to(tl.int64) * stride_os + head * stride_oh + d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def default_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits so that a CUDA device gets about two programs per SM; 1 elsewhere (interpreter)."""
    if device.type != "cuda":
        return 1
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(2 * num_sms, num_seqs * num_kv_heads)
    return max(1, min(wanted, triton.cdiv(max_seq_len, 512), 16))


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence attends over its whole paged context (no mask needed: the
    query is the last token). Returns ``[S, H_q, D]`` in the query's dtype: ``out`` when given
    (every element is written), else a new tensor.

    Args:
        query: ``[S, H_q, D]``, last dim contiguous; the cache's dtype (any float dtype for an
            8-bit cache).
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]``, last dim contiguous; or 8-bit
            (float8_e4m3fn / int8) packed rows ``[..., D + 4]`` (:mod:`engine.kv_cache.kv_quant`).
        block_tables: ``[S, max_blocks]`` int64, same device (padding entries are never read).
        seq_lens: ``[S]`` int64, same device: context length including this step's token, >= 1.
        max_seq_len: ``max(seq_lens)``, used only to size the splits.
        scale: softmax scale, usually ``D ** -0.5``.
        num_splits: context splits per (sequence, KV head); ``None`` picks by device.
        block_n: context tokens per tile, a power of two >= 16; ``None``: 64, or 32 for rows of
            512+ bytes (fp32 with D=128) so the pipelined K/V tiles fit in shared memory.
        out: ``[S, H_q, D]`` like ``query``, last dim contiguous; mutated.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, mismatched head dims, or dtypes.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    block_n = prepare_paged_launch(_decode_kernel, query, kv_cache, block_n)
    kv_quant, kv_cache = quant_launch(kv_cache)
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_seq_len, query.device)
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max(max_seq_len, 1), split_len))
    out = output_like(out, query)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if num_splits == 1:
        partial, lse = out[:, :, None, :], out  # lse is not written
    else:
        partial = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    block_d = triton.next_power_of_2(head_dim)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, kv_cache, block_tables, seq_lens, partial, lse,
        scale * LOG2E,
        query.stride(0), query.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        partial.stride(0), partial.stride(1), partial.stride(2),
        split_len,
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        PRECISION="ieee" if query.dtype == torch.float32 or kv_quant else "tf32", WRITE_LSE=num_splits > 1,
        KV_QUANT=kv_quant,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, num_heads)](
            partial, lse, out, num_splits,
            partial.stride(0), partial.stride(1), partial.stride(2), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SPLITS=triton.next_power_of_2(num_splits),
        )
    return out
