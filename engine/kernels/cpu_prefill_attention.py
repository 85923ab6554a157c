"""Paged prefill attention for the CPU: a small C kernel (``cpu/paged_prefill_attention.c``) that
runs one prompt chunk's causal attention over its context read in place through the block table,
compiled once per machine (:mod:`engine.kernels.cpu_build`).

It replaces torch's ``scaled_dot_product_attention`` for a chunk on a float32 or bfloat16 cache
where it runs (head_dim a multiple of the vector width, at most 128): register-blocked score and
weighted-sum tiles where torch's CPU flash attention spent most of a short chunk's time on per-call
and per-block work (27-50 GFLOPS for a 97-200 token chunk of SmolLM2-135M on a 2-core AMD Zen 4).
Where no compiler works, or the C source is not installed, :func:`load_kernel` logs a warning and
returns None, and :class:`engine.cpu_attention.CpuAttentionBackend` keeps SDPA.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import cpu_build


SOURCE = Path(__file__).parent / "cpu" / "paged_prefill_attention.c"

# The K/V dtypes the kernel reads (widened to float32 as they are read); the query is float32.
KV_DTYPES = (torch.float32, torch.bfloat16)
_ENTRY_POINTS = {torch.float32: "paged_prefill_attention_f32", torch.bfloat16: "paged_prefill_attention_bf16"}


def _declare(lib: ctypes.CDLL) -> None:
    for name in _ENTRY_POINTS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + \
            [ctypes.c_void_p] + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_int]


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU prefill-attention kernel", "prompt chunks use SDPA", _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, compiling it first if needed; None (logged once) when it cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


def runs(kernel: ctypes.CDLL | None, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_prefill_attention_cpu` takes this query and cache (else SDPA): a
    float32 or bfloat16 CPU query and a contiguous cache of those dtypes, head_dim a multiple of
    16 (of 8 on AVX2 builds, 16 asked here for both) and at most 128."""
    head_dim = kv_cache.shape[-1]
    return kernel is not None and query.device.type == "cpu" and query.dtype in KV_DTYPES \
        and kv_cache.dtype in KV_DTYPES and head_dim % 16 == 0 and head_dim <= 128 and kv_cache.is_contiguous()


def paged_prefill_attention_cpu(
    kernel: ctypes.CDLL,
    query: torch.Tensor,  # [q_len, num_heads, head_dim], float32 or bfloat16, heads contiguous, any token stride
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16, contiguous
    blocks: torch.Tensor,  # [>= ceil(ctx / block_size)], int64: the sequence's block table
    ctx: int,  # context tokens, the chunk's own included (its last q_len)
    scale: float,
) -> torch.Tensor:  # [q_len, num_heads, head_dim], the query's dtype
    """Causal attention of a prompt chunk: query row i (position ``ctx - q_len + i``) attends
    context tokens ``0 .. ctx - q_len + i``, read through ``blocks`` from the cache (the chunk's
    own K/V written there first). Scores, softmax and output accumulate in float32 (a bfloat16
    query is widened first, the output rounded to bfloat16 once at the end).

    The C code trusts the block ids; every shape is checked here.

    Raises:
        ValueError: a dtype, device, layout or shape the kernel does not take (:func:`runs`), a
            context shorter than the chunk or longer than the table covers.
        MemoryError: the kernel could not allocate its scratch.
    """
    if not runs(kernel, query, kv_cache):
        raise ValueError(f"a float32 or bfloat16 CPU query and contiguous cache with head_dim a multiple of 16 up "
                         f"to 128 only, got {query.dtype} query on {query.device}, {kv_cache.dtype} cache "
                         f"{tuple(kv_cache.shape)}")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    q_len, num_heads = query.shape[0], query.shape[1]
    if query.dim() != 3 or query.shape[2] != head_dim or num_heads % num_kv_heads or query.stride(2) != 1 \
            or query.stride(1) != head_dim:
        raise ValueError(f"query {tuple(query.shape)} strides {query.stride()} does not fit cache "
                         f"{tuple(kv_cache.shape)}")
    if blocks.dtype != torch.int64 or blocks.dim() != 1 or not blocks.is_contiguous() \
            or not q_len <= ctx <= blocks.shape[0] * block_size or q_len < 1:
        raise ValueError(f"need 1 <= q_len ({q_len}) <= ctx ({ctx}) <= {blocks.shape[0]} blocks x {block_size} "
                         f"and a contiguous int64 block table")
    out_dtype = query.dtype
    if out_dtype != torch.float32:
        query = query.float()
    out = torch.empty(q_len, num_heads, head_dim, dtype=torch.float32)
    fn = getattr(kernel, _ENTRY_POINTS[kv_cache.dtype])
    status = fn(query.data_ptr(), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), blocks.data_ptr(),
                q_len, ctx, out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, scale,
                torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"prefill attention: no scratch for a {ctx}-token context")
    if status:
        raise ValueError(f"the kernel does not take head_dim {head_dim} on this build")
    return out if out_dtype == torch.float32 else out.to(out_dtype)
