"""TritonAttentionBackend: the :class:`engine.attention.AttentionBackend` on Triton kernels.

Same contract as the readable :class:`engine.attention.TorchAttentionBackend`: write this
step's K/V into the paged cache at ``slot_mapping``, then attend each query over its whole
context with the causal mask offset by the cached context. All-decode steps (every query length
1) take the split-KV decode kernel; any other step the varlen prefill kernel, which also serves
the decode rows of a mixed step.

The kernels run on CUDA tensors, or on any device under ``TRITON_INTERPRET=1`` (set before this
module is imported; see :mod:`engine.kernels`).
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata
from engine.kernels.kv_cache_write import kv_cache_write
from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kernels.paged_prefill_attention import paged_prefill_attention


class TritonAttentionBackend:
    """Stateless apart from a per-step copy of the metadata's CPU tensors on the device."""

    def __init__(self) -> None:
        # Every layer of a step gets the same metadata object: copy its CPU tensors to the
        # device once per step, not once per layer.
        self._meta: AttentionMetadata | None = None
        self._device_lens: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """AttentionBackend.forward (shapes there); mutates ``kv_cache``."""
        kv_cache_write(key, value, kv_cache, meta.slot_mapping)
        query_start_loc, seq_lens = self._lens_on(meta, kv_cache.device)
        if meta.max_query_len == 1:
            return paged_decode_attention(query, kv_cache, meta.block_tables, seq_lens, meta.max_seq_len, scale)
        return paged_prefill_attention(
            query, kv_cache, meta.block_tables, query_start_loc, seq_lens, meta.max_query_len, scale
        )

    def _lens_on(self, meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._meta is not meta or self._device_lens[0].device != device:
            self._meta = meta
            self._device_lens = (meta.query_start_loc.to(device), meta.seq_lens.to(device))
        return self._device_lens
