"""Block pack / unpack for KV transfer: gather a request's blocks from every layer of the paged
cache into one contiguous staging buffer, and scatter a staging buffer back (the block copy of
vLLM's KV connectors; PagedAttention, Kwon et al. SOSP'23).

Reference: :func:`engine.kv_connector.pack_blocks` / :func:`~engine.kv_connector.unpack_blocks`
(``index_select`` + ``permute`` and ``index_copy_``).

::

    kv_cache [num_layers, 2, num_blocks, block_size, H_kv, D]
                 │  │        │
                 └──┴─ plane └─ block_ids[j]          one "chunk" = block_size * H_kv * D
    staging  [n, num_layers, 2, block_size, H_kv, D]  elements, contiguous on both sides
              └─ j
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels import check_launchable

# Elements per program; a block's chunk is split over several programs when larger.
BLOCK = 4096


@triton.jit
def _block_copy_kernel(
    cache_ptr, staging_ptr, block_ids_ptr,
    num_planes,  # num_layers * 2
    num_blocks,
    chunk,  # elements of one block in one plane
    TO_STAGING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    j = tl.program_id(0)  # index into block_ids
    plane = tl.program_id(1)
    i = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    mask = i < chunk
    block = tl.load(block_ids_ptr + j).to(tl.int64)
    cache_off = (plane.to(tl.int64) * num_blocks + block) * chunk + i
    staging_off = (j.to(tl.int64) * num_planes + plane) * chunk + i
    if TO_STAGING:
        tl.store(staging_ptr + staging_off, tl.load(cache_ptr + cache_off, mask=mask), mask=mask)
    else:
        tl.store(cache_ptr + cache_off, tl.load(staging_ptr + staging_off, mask=mask), mask=mask)


def _launch(kv_cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor, to_staging: bool) -> None:
    num_layers, _, num_blocks = kv_cache.shape[:3]
    chunk = kv_cache[0, 0, 0].numel()
    grid = (block_ids.numel(), num_layers * 2, triton.cdiv(chunk, BLOCK))
    _block_copy_kernel[grid](
        kv_cache, staging, block_ids, num_layers * 2, num_blocks, chunk, TO_STAGING=to_staging, BLOCK=BLOCK
    )


def _check(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous [L, 2, blocks, bs, H_kv, D], got {tuple(kv_cache.shape)}")
    if block_ids.dim() != 1 or block_ids.device != kv_cache.device:
        raise ValueError(f"block_ids must be 1-D on {kv_cache.device}: {tuple(block_ids.shape)} on {block_ids.device}")
    check_launchable(_block_copy_kernel, kv_cache)


def _staging_shape(kv_cache: torch.Tensor, n: int) -> tuple[int, ...]:
    return (n, kv_cache.shape[0], 2, *kv_cache.shape[3:])


def _check_staging(kv_cache: torch.Tensor, staging: torch.Tensor, n: int) -> None:
    expected = _staging_shape(kv_cache, n)
    if tuple(staging.shape) != expected or staging.dtype != kv_cache.dtype or not staging.is_contiguous():
        raise ValueError(
            f"staging must be a contiguous {kv_cache.dtype} {expected}, got {staging.dtype} {tuple(staging.shape)}"
        )
    if staging.device != kv_cache.device:
        raise ValueError(f"staging on {staging.device}, cache on {kv_cache.device}")


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Returns a staging buffer ``[n, num_layers, 2, block_size, H_kv, D]`` (cache dtype and
    device) holding blocks ``block_ids`` (``[n]`` int64, on the cache's device): ``out`` when
    given (mutated, every element written), else a new tensor. Reads the cache only.

    Raises:
        ValueError: a non-contiguous or mis-shaped cache, or block ids elsewhere.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(kv_cache, block_ids)
    n = block_ids.numel()
    if out is None:
        out = torch.empty(_staging_shape(kv_cache, n), dtype=kv_cache.dtype, device=kv_cache.device)
    _check_staging(kv_cache, out, n)
    if n:
        _launch(kv_cache, out, block_ids, to_staging=True)
    return out


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor) -> None:
    """Writes ``staging[j]`` into block ``block_ids[j]`` of every layer. Mutates ``kv_cache``.

    Args:
        staging: ``[n, num_layers, 2, block_size, H_kv, D]``, contiguous, the cache's dtype and device.

    Raises:
        ValueError: as :func:`gather_blocks`, or a staging buffer of another shape or dtype.
        RuntimeError: CPU tensors without ``TRITON_INTERPRET=1``.
    """
    _check(kv_cache, block_ids)
    n = block_ids.numel()
    _check_staging(kv_cache, staging, n)
    if n:
        _launch(kv_cache, staging, block_ids, to_staging=False)
