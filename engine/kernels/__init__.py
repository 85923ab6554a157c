"""Triton kernels for the engine's hot paths, each beside the torch reference it must match.

Every module holds one kernel and a plain Python wrapper that allocates the output and launches
it. Without a GPU the kernels run only under Triton's interpreter, which must be switched on
(``TRITON_INTERPRET=1``) before any module of this package is imported: ``triton.jit`` picks
compiled or interpreted at decoration time.
"""

from __future__ import annotations

import torch

from engine.kv_cache.kv_quant import head_dim_of, is_quantized


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Raises RuntimeError when ``kernel`` cannot run on ``tensor``'s device.

    A compiled kernel needs CUDA tensors; an interpreted one (``TRITON_INTERPRET=1``) takes any.
    """
    if tensor.is_cuda or is_interpreted(kernel):
        return
    raise RuntimeError(
        f"Triton kernel {getattr(kernel, '__name__', kernel)} got a "
        f"{tensor.device} tensor: run on a CUDA device, or set TRITON_INTERPRET=1 before "
        "engine.kernels is imported"
    )


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` was decorated while ``TRITON_INTERPRET=1`` was set."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def output_like(out: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Returns ``out`` after checking it matches ``like`` (shape, dtype, device, contiguous last
    dim), or a new ``torch.empty_like(like)`` when ``out`` is None.

    Raises:
        ValueError: ``out`` does not match.
    """
    if out is None:
        return torch.empty_like(like)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device or out.stride(-1) != 1:
        raise ValueError(
            f"out {out.dtype} {tuple(out.shape)} on {out.device} does not match {like.dtype} {tuple(like.shape)}"
        )
    return out


def check_paged_query(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Checks a paged attention kernel's query ``[T, H_q, D]`` against its cache
    ``[2, num_blocks, block_size, H_kv, D]``.

    Raises:
        ValueError: ``H_q`` not a multiple of ``H_kv``, mismatched head dims or dtypes, or a
            last dimension that is not contiguous.
    """
    _, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if head_dim != head_dim_of(kv_cache) or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if query.dtype != kv_cache.dtype and not is_quantized(kv_cache):
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {kv_cache.dtype}")
    if query.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("query and kv_cache need a contiguous last dimension")


def prepare_paged_launch(kernel, query: torch.Tensor, kv_cache: torch.Tensor, block_n: int | None) -> int:
    """Checks a paged attention launch (:func:`check_paged_query`, :func:`check_launchable`) and
    returns its keys per tile: ``block_n``, or :func:`default_block_n` when None.

    Raises:
        ValueError, RuntimeError: as those checks.
    """
    check_paged_query(query, kv_cache)
    check_launchable(kernel, kv_cache)
    return block_n or default_block_n(query)


def default_block_n(query: torch.Tensor) -> int:
    """Keys per attention tile: 64, or 32 when one K row is 512+ bytes (fp32, D=128), so that
    three pipelined K and V tiles stay well inside a Hopper SM's shared memory."""
    return 32 if query.element_size() * query.shape[-1] >= 512 else 64


def quant_launch(kv_cache: torch.Tensor) -> tuple[int, torch.Tensor]:
    """``(KV_QUANT, cache to pass)`` for a paged attention kernel: ``(0, kv_cache)`` for a float
    cache, ``(1, kv_cache)`` for int8, ``(2, kv_cache viewed as uint8)`` for float8 e4m3fn (the
    kernels decode its bits themselves, so the interpreter needs no float8 support)."""
    if kv_cache.dtype == torch.int8:
        return 1, kv_cache
    if kv_cache.dtype == torch.float8_e4m3fn:
        return 2, kv_cache.view(torch.uint8)
    return 0, kv_cache
