"""Paged attention: the forward context, its metadata, and the readable torch backend.

The KV cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; a request's
tokens live in the blocks its block table lists, token ``p`` at slot
``block_table[p // block_size] * block_size + p % block_size``. An 8-bit cache (fp8 / int8) has
rows of ``head_dim + 4``: the values, then their float32 scale (:mod:`engine.kv_cache.kv_quant`);
every backend writes quantised rows and attends over their dequantised values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.kv_cache.kv_quant import as_values, is_quantized, quantize_rows, write_rows


@dataclass
class AttentionMetadata:
    """Where this step's tokens come from and go to. Built by the ModelRunner once per step.

    ::

        tokens:        | req0 q0..q2 | req1 q0 | req2 q0..q4 |     (flattened, no padding)
        query_start_loc  0            3         4             9
        seq_lens         ctx0         ctx1      ctx2   (cached + this step's tokens)
    """

    slot_mapping: torch.Tensor  # [num_tokens], int64: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1], int64, on CPU
    seq_lens: torch.Tensor  # [num_seqs], int64, on CPU: context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks], int64 (padded with 0)
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache, then attends each query over its context."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim (+ 4 when 8-bit)]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters ``key``/``value`` ([num_tokens, num_kv_heads, head_dim]) into ``kv_cache`` at
    ``slot_mapping``, quantised to packed rows when the cache is 8-bit. Mutates ``kv_cache``."""
    if is_quantized(kv_cache):
        write_rows(quantize_rows(key, kv_cache.dtype), kv_cache[0], slot_mapping)
        write_rows(quantize_rows(value, kv_cache.dtype), kv_cache[1], slot_mapping)
        return
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


class TorchAttentionBackend:
    """Reference backend: gathers each sequence's K/V through its block table, then SDPA.

    All-decode steps (every query length 1) run as one padded batch; mixed steps loop over
    sequences with a causal mask offset by the cached context.
    """

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        write_kv(key, value, kv_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            return self._decode(query, kv_cache, meta, scale)
        out = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        for i, ctx in enumerate(meta.seq_lens.tolist()):
            q = query[starts[i] : starts[i + 1]]  # [q_len, num_heads, head_dim]
            k, v = self._gather(kv_cache, meta.block_tables[i], ctx)  # [ctx, num_kv_heads, head_dim]
            k, v = as_values(k, q.dtype), as_values(v, q.dtype)
            q_len = q.shape[0]
            # Query j sits at absolute position ctx - q_len + j and sees keys 0..that position.
            mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril(diagonal=ctx - q_len)
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
            )
            out[starts[i] : starts[i + 1]] = o.transpose(0, 1)
        return out

    @staticmethod
    def _gather(kv_cache: torch.Tensor, block_table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows of the first ``ctx`` tokens: two [ctx, num_kv_heads, row], the cache's dtype."""
        block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
        blocks = block_table[: (ctx + block_size - 1) // block_size]
        k = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        return k, v

    @staticmethod
    def _decode(query, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        block_size, num_kv_heads = kv_cache.shape[2:4]
        head_dim = query.shape[-1]
        num_blocks = (meta.max_seq_len + block_size - 1) // block_size
        tables = meta.block_tables[:, :num_blocks]
        # [num_seqs, num_kv_heads, max_ctx, head_dim]
        k = as_values(kv_cache[0, tables], query.dtype).reshape(meta.num_seqs, -1, num_kv_heads, head_dim)
        v = as_values(kv_cache[1, tables], query.dtype).reshape(meta.num_seqs, -1, num_kv_heads, head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        positions = torch.arange(k.shape[2], device=query.device)
        mask = (positions[None, :] < meta.seq_lens.to(query.device)[:, None])[:, None, None, :]
        o = F.scaled_dot_product_attention(query[:, :, None, :], k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[:, :, 0, :]


@dataclass
class ForwardContext:
    """The one piece of ambient state (docs/style.md principle 7): what attention layers read during a forward."""

    meta: AttentionMetadata
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]  # per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]


_forward_context: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[None]:
    """Makes ``ctx`` visible to attention layers for the duration of one forward pass."""
    global _forward_context
    previous, _forward_context = _forward_context, ctx
    try:
        yield
    finally:
        _forward_context = previous


def get_forward_context() -> ForwardContext:
    """Raises RuntimeError outside a :func:`forward_context` block."""
    if _forward_context is None:
        raise RuntimeError("attention called outside forward_context()")
    return _forward_context


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                    scale: float) -> torch.Tensor:
    """Layer ``layer_idx``'s attention through the forward context's backend, cache and metadata:
    writes ``key``/``value`` ([num_tokens, num_kv_heads, head_dim]) into that layer's paged cache,
    returns ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.

    Eagerly a plain call; under ``torch.compile`` the custom op :func:`paged_attention_op`.
    """
    if torch.compiler.is_compiling():
        return paged_attention_op(query, key, value, layer_idx, scale)
    ctx = get_forward_context()
    return ctx.backend.forward(query, key, value, ctx.kv_caches[layer_idx], ctx.meta, scale)


@torch.library.custom_op("tandem::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                    scale: float) -> torch.Tensor:
    """:func:`paged_attention` as a custom op, so that ``torch.compile`` keeps it as one opaque call (block tables and
    sequence lengths change every step; the rest of the layer is compiled around it). The KV
    cache write is a side effect the compiler does not see, which is safe: nothing in the graph
    reads the cache.
    """
    ctx = get_forward_context()
    return ctx.backend.forward(query, key, value, ctx.kv_caches[layer_idx], ctx.meta, scale)


@paged_attention_op.register_fake
def _(query, key, value, layer_idx, scale):
    return torch.empty_like(query)
