"""KV connector mechanics: copy whole blocks between the paged KV cache and transfer bytes.

A block's bytes are its ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` slice of the cache
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous, native dtype
(DESIGN.md §4). How the bytes reach the pool is the worker's business.

On CUDA the staging copy is one Triton kernel (:mod:`engine.kernels.block_copy`); elsewhere torch
indexing does it.
"""

from __future__ import annotations

import torch


def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> list[bytes]:
    """Returns one bytes object per block id, in order. Reads only."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    if kv_cache.is_cuda:
        from engine.kernels.block_copy import gather_blocks

        staged = gather_blocks(kv_cache, ids).cpu()
    else:
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        staged = kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    flat = staged.view(len(block_ids), -1).view(torch.uint8)
    return [flat[i].numpy().tobytes() for i in range(len(block_ids))]


def unpack_blocks(kv_cache: torch.Tensor, block_ids: list[int], payloads: list[bytes | memoryview]) -> None:
    """Writes ``payloads[i]`` into block ``block_ids[i]``. Mutates ``kv_cache``.

    Raises:
        ValueError: counts differ, or a payload's size is not one block's.
    """
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    if not block_ids:
        return
    shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    block_bytes = kv_cache.element_size() * kv_cache[:, :, 0].numel()
    for p in payloads:
        if len(p) != block_bytes:
            raise ValueError(f"payload of {len(p)} bytes, a block is {block_bytes}")
    blob = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    staged = blob.view(kv_cache.dtype).view(len(block_ids), *shape).to(kv_cache.device)
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    if kv_cache.is_cuda:
        from engine.kernels.block_copy import scatter_blocks

        scatter_blocks(kv_cache, ids, staged)
    else:
        kv_cache.index_copy_(2, ids, staged.permute(1, 2, 0, 3, 4, 5))
