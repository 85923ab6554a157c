"""CpuAttentionBackend: the :class:`engine.attention.AttentionBackend` laid out for a CPU.

Same contract and results as the readable :class:`engine.attention.TorchAttentionBackend`; what
differs is what each step touches:

* Decode rows (query length 1) of a step, whether the step is all-decode or mixed, run as one
  batch through the C kernel of :mod:`engine.kernels.cpu_decode_attention`, which reads every
  sequence's K/V in place through its block table. For a dtype it does not take (it reads float32
  and bfloat16 K/V) or where it cannot be compiled, their blocks are gathered with ``index_select`` (one
  contiguous copy per layer, ~5x cheaper than advanced indexing here), then one SDPA call with a
  length mask.
* A prompt chunk on a float32 or bfloat16 cache runs through the C kernel of
  :mod:`engine.kernels.cpu_prefill_attention`: causal attention over its context read in place
  through the block table (its own K/V written there first, any cached context before it:
  chunked prefill, a prefix-cache hit, KV loaded from the pool), 1.6-2.4x torch's CPU flash
  attention for 97-400 token chunks on a 2-core AMD Zen 4. Without the kernel (no compiler, a head
  size it does not take) a chunk with no cached context attends over its own K/V directly (causal
  SDPA), and a chunk after cached context gathers its context blocks once, with the causal mask
  offset by the cached length.

On an 8-bit cache (``--kv-cache-dtype fp8|int8``) the write quantises (one C call for float32
K/V), decode rows take the kernel's 8-bit entry points, and every prompt chunk attends over the
dequantised rows the cache holds, its own included (gathered and dequantised by one C call), so a
chunk attends to the same values whether its context was computed here, cached or loaded from
the pool.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.attention import AttentionMetadata, write_kv
from engine.kernels.cpu_decode_attention import (KV_DTYPES, QUERY_DTYPES, load_kernel, paged_decode_attention_cpu,
                                                 paged_gather_q8_cpu, paged_kv_write_cpu, paged_kv_write_q8_cpu)
from engine.kernels.cpu_prefill_attention import load_kernel as load_prefill_kernel
from engine.kernels.cpu_prefill_attention import paged_prefill_attention_cpu, runs as prefill_kernel_runs
from engine.kv_cache.kv_quant import as_values, is_quantized


class CpuAttentionBackend:
    """Stateless; per step it splits the rows once (cached on the metadata object).

    ``use_kernel``: False keeps decode rows on gather + SDPA and prompt chunks on SDPA (the
    kernels' own fallbacks).
    """

    def __init__(self, use_kernel: bool = True) -> None:
        self._meta: AttentionMetadata | None = None
        self._plan: _StepPlan | None = None
        self._kernel = load_kernel() if use_kernel else None
        self._prefill_kernel = load_prefill_kernel() if use_kernel else None

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """AttentionBackend.forward (shapes there); mutates ``kv_cache``."""
        quantized = is_quantized(kv_cache)
        rows_fit = key.stride(2) == 1 and key.stride(1) == key.shape[2] and value.stride(2) == 1 \
            and value.stride(1) == value.shape[2]
        if self._kernel is not None and rows_fit and key.dtype == (torch.float32 if quantized else kv_cache.dtype):
            write = paged_kv_write_q8_cpu if quantized else paged_kv_write_cpu
            write(self._kernel, key, value, kv_cache, meta.slot_mapping)
        else:
            write_kv(key, value, kv_cache, meta.slot_mapping)
        plan = self._plan_for(meta, kv_cache.shape[2])
        if plan.all_decode:
            return self._decode(query, kv_cache, plan, scale)
        out = torch.empty_like(query)
        if plan.decode_rows is not None:
            out[plan.decode_rows] = self._decode(query[plan.decode_rows], kv_cache, plan, scale)
        prefill_kernel = self._prefill_kernel if not quantized and \
            prefill_kernel_runs(self._prefill_kernel, query, kv_cache) else None
        for start, end, ctx, blocks in plan.prefills:
            if prefill_kernel is not None:
                out[start:end] = paged_prefill_attention_cpu(prefill_kernel, query[start:end], kv_cache, blocks, ctx,
                                                             scale)
                continue
            # 4-D [1, H, q_len, D]: torch's CPU flash-attention kernel takes only 4-D inputs (a 3-D
            # call falls back to the math path, which materialises every score and repeats K/V
            # for the query groups: 2-3x slower for a 100-400 token chunk here).
            q, q_len = query[start:end].transpose(0, 1)[None], end - start
            if ctx == q_len and not quantized:  # nothing cached before this chunk: its own K/V suffice
                k, v = key[start:end], value[start:end]
            elif quantized and self._kernel is not None:  # gathered and dequantised in one C pass
                k, v = paged_gather_q8_cpu(self._kernel, kv_cache, blocks, ctx)
                k, v = k.to(q.dtype), v.to(q.dtype)
            else:
                k, v = _gather(kv_cache, blocks, ctx)
                k, v = as_values(k, q.dtype), as_values(v, q.dtype)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if ctx == q_len:  # no cached context: the plain causal mask, which the flash kernel
                # applies by skipping the blocks above the diagonal
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        return out

    def _decode(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float) -> torch.Tensor:
        if self._kernel is not None and query.dtype in QUERY_DTYPES and kv_cache.dtype in KV_DTYPES:
            return paged_decode_attention_cpu(self._kernel, query, kv_cache, plan.decode_tables, plan.decode_lens, scale)
        return _decode(query, kv_cache, plan.decode_tables, plan.decode_mask, scale)

    def _plan_for(self, meta: AttentionMetadata, block_size: int) -> _StepPlan:
        if self._meta is not meta:
            self._meta, self._plan = meta, _StepPlan(meta, block_size)
        return self._plan


class _StepPlan:
    """How one step's rows split into decode rows and prompt chunks (shared by every layer)."""

    def __init__(self, meta: AttentionMetadata, block_size: int):
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        q_lens = [b - a for a, b in zip(starts, starts[1:])]
        self.all_decode = meta.max_query_len == 1
        decode = [i for i, n in enumerate(q_lens) if n == 1]
        # Where the decode rows sit among the step's tokens (an all-decode step uses them all).
        self.decode_rows = torch.tensor([starts[i] for i in decode], dtype=torch.long) \
            if decode and not self.all_decode else None
        self.decode_tables = self.decode_lens = None
        if decode:
            lens = meta.seq_lens if self.all_decode else meta.seq_lens[decode]
            self.decode_lens = lens.contiguous()  # [num_decode], int64
            max_len = max(seq_lens[i] for i in decode)
            num_blocks = -(-max_len // block_size)
            tables = meta.block_tables if self.all_decode else meta.block_tables[decode]
            self.decode_tables = tables[:, :num_blocks].contiguous()  # [num_decode, num_blocks]
        self._block_size = block_size
        # (start, end, context length, block ids) of each prompt chunk.
        self.prefills = [
            (starts[i], starts[i + 1], seq_lens[i], meta.block_tables[i, : -(-seq_lens[i] // block_size)])
            for i, n in enumerate(q_lens) if n > 1
        ]


    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decode, 1, 1, num_blocks x block_size], bool: which gathered keys each decode row
        sees. Only the gather + SDPA fallback needs it, so it is built on first use."""
        positions = torch.arange(self.decode_tables.shape[1] * self._block_size)
        return (positions[None, :] < self.decode_lens[:, None])[:, None, None, :]


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V rows of the first ``ctx`` tokens held in ``blocks``: two [ctx, num_kv_heads, row] of
    the cache's dtype (row: head_dim, or head_dim + 4 packed 8-bit)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    k = kv_cache[0].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx]
    v = kv_cache[1].index_select(0, blocks).view(-1, num_kv_heads, head_dim)[:ctx]
    return k, v


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """One query per sequence over its paged context. query [n, H, D], tables [n, num_blocks],
    mask [n, 1, 1, num_blocks x block_size] -> [n, H, D]."""
    n, num_blocks = tables.shape
    num_kv_heads, head_dim = kv_cache.shape[3], query.shape[-1]
    flat = tables.reshape(-1)
    k = as_values(kv_cache[0].index_select(0, flat), query.dtype).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    v = as_values(kv_cache[1].index_select(0, flat), query.dtype).view(n, -1, num_kv_heads, head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return o[:, :, 0, :]
