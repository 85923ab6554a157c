"""KV connector mechanics: copy whole blocks between the paged KV cache and transfer bytes.

A block's bytes are its ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` slice of the cache
``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``, C-contiguous, native dtype
(docs/design.md §4). How the bytes reach the pool is the worker's business. An 8-bit cache's block
is its packed rows (values and float32 scales, :mod:`engine.kv_cache.kv_quant`), moved as bytes.

Payloads to load are ``bytes`` (gRPC, NIXL, host swap) or :class:`ArenaBlock` views of a pool's
shared-memory arena mapped into this process (``engine.kv_connector.pool_io`` on the shm backend): those are
copied straight from the mapping into their cache blocks, with no copy in between, and then the
pool lease that kept their slots in place is let go (:class:`LoadGuard`).

On CUDA the staging copy is one Triton kernel (:mod:`engine.kernels.block_copy`); on the CPU
each block is one numpy copy into its slot (torch indexing for packing).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np
import torch

from engine.outputs import let_go


class LoadGuard:
    """Keeps pool blocks leased until their bytes are in the KV cache: ``on_done`` runs once, when
    ``done`` is called (after the copy) or when the last :class:`ArenaBlock` holding this guard
    is garbage (the request went away before its KV was loaded). Thread-safe: ``weakref.finalize``
    runs its callback at most once."""

    def __init__(self, on_done: Callable[[], None]):
        self._finalizer = weakref.finalize(self, on_done)

    def done(self) -> None:
        """Runs ``on_done`` unless it ran already. Called from the engine's step loop."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive


class ArenaBlock(np.ndarray):
    """One block's bytes, ``[block_bytes]`` uint8, as a view of a pool's mapped arena (no copy).

    Valid only while ``guard`` is not done: the pool may reuse the slot afterwards. Behaves as a
    bytes-like object (``len``, ``bytes()``, ``memoryview``); compare with ``bytes(block)``.
    """

    guard: LoadGuard | None

    @classmethod
    def wrap(cls, view: memoryview, guard: LoadGuard) -> ArenaBlock:
        block = np.frombuffer(view, dtype=np.uint8).view(cls)
        block.guard = guard
        return block

    def __array_finalize__(self, obj) -> None:
        self.guard = getattr(obj, "guard", None)


def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> list[bytes]:
    """Returns one bytes object per block id, in order. Reads only."""
    if not block_ids:
        return []
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    if kv_cache.is_cuda:
        from engine.kernels.block_copy import gather_blocks

        staged = gather_blocks(_bytes_if_8bit(kv_cache), ids).cpu()
    else:
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        staged = kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
    flat = staged.view(len(block_ids), -1).view(torch.uint8)
    return [flat[i].numpy().tobytes() for i in range(len(block_ids))]


def unpack_blocks(
    kv_cache: torch.Tensor, block_ids: list[int], payloads: list[bytes | memoryview | ArenaBlock]
) -> None:
    """Writes ``payloads[i]`` into block ``block_ids[i]``; then lets go of the pool leases of
    :class:`ArenaBlock` payloads (their ``LoadGuard``). Mutates ``kv_cache``.

    Raises:
        ValueError: counts differ, or a payload's size is not one block's.
    """
    if len(block_ids) != len(payloads):
        raise ValueError(f"{len(block_ids)} block ids for {len(payloads)} payloads")
    if not block_ids:
        return
    block_bytes = kv_cache.element_size() * kv_cache[:, :, 0].numel()
    for p in payloads:
        if len(p) != block_bytes:
            raise ValueError(f"payload of {len(p)} bytes, a block is {block_bytes}")
    try:
        if kv_cache.is_cuda:
            _copy_staged(kv_cache, block_ids, payloads)
        else:
            _copy_into_slots(kv_cache, block_ids, payloads)
    finally:
        let_go(payloads)


def _copy_into_slots(kv_cache: torch.Tensor, block_ids: list[int], payloads: list) -> None:
    """One copy per block, from the payload (an ArenaBlock: the mapped arena itself) straight
    into the cache's block slot.

    numpy, on the cache's bytes (any dtype, bf16 too): single-threaded and without the GIL. Here
    a torch ``copy_`` per block measured 3-15x slower (an OpenMP fork-join per small copy under
    load) and the staged ``index_copy_`` ~20x slower.
    """
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim * element_size], uint8
    cache_bytes = kv_cache.view(torch.uint8).numpy()
    shape = (cache_bytes.shape[0], cache_bytes.shape[1], *cache_bytes.shape[3:])
    for block_id, payload in zip(block_ids, payloads):
        cache_bytes[:, :, block_id] = np.frombuffer(payload, dtype=np.uint8).reshape(shape)


def _copy_staged(kv_cache: torch.Tensor, block_ids: list[int], payloads: list) -> None:
    """All blocks through one staging tensor: one host-to-device copy, one scatter kernel."""
    kv_cache = _bytes_if_8bit(kv_cache)
    shape = (kv_cache.shape[0], kv_cache.shape[1], *kv_cache.shape[3:])
    blob = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8)
    staged = blob.view(kv_cache.dtype).view(len(block_ids), *shape).to(kv_cache.device)
    ids = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    from engine.kernels.block_copy import scatter_blocks

    scatter_blocks(kv_cache, ids, staged)


def _bytes_if_8bit(kv_cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit cache as uint8 (same shape): the block-copy kernel then needs no float8 type on
    the device."""
    return kv_cache.view(torch.uint8) if kv_cache.element_size() == 1 else kv_cache
