"""Paged decode attention for the CPU: a small C kernel (``cpu/paged_decode_attention.c``) that
reads each sequence's K/V in place through its block table, compiled once per machine.

The C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) and
``-O3 -march=native -fopenmp`` into the Tandem cache folder, keyed by the source, the flags and
this CPU's instruction-set flags, so every machine gets code for its own ISA (AVX-512 on one,
AVX2 on another) and later starts load it in milliseconds. The kernel shares torch's OpenMP
runtime (the same ``libgomp.so.1``) and uses torch's thread count.

Where no compiler works, or the C source is not installed (a wheel or image built without the
package data), :func:`load_kernel` logs a warning and returns None, and callers keep the torch
path (:class:`engine.cpu_attention.CpuAttentionBackend` falls back to gather + SDPA).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from engine.kernels import cpu_build
from engine.kv_cache.kv_quant import head_dim_of, is_quantized


SOURCE = Path(__file__).parent / "cpu" / "paged_decode_attention.c"


def library_path() -> Path:
    """Where the compiled kernel for this source, these flags and this CPU lives.

    Raises:
        FileNotFoundError: the C source is not installed next to this module.
    """
    return cpu_build.library_path(SOURCE)


def _declare(lib: ctypes.CDLL) -> None:
    for fn in (lib.paged_decode_attention_f32, lib.paged_decode_attention_bf16, lib.paged_decode_attention_i8,
               lib.paged_decode_attention_fp8):
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
            [ctypes.c_int] * 5 + [ctypes.c_float, ctypes.c_int]
    lib.paged_kv_write.restype = ctypes.c_int64
    lib.paged_kv_write.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.paged_kv_write_q8.restype = ctypes.c_int64
    lib.paged_kv_write_q8.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64] + \
        [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
    lib.paged_gather_q8.restype = None
    lib.paged_gather_q8.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] + [ctypes.c_int] * 4 + [ctypes.c_void_p] * 2


_KERNEL = cpu_build.CachedKernel(SOURCE, "CPU paged-attention kernel", "using gather + SDPA", _declare)


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, compiling it first if needed; None (logged once) when it cannot be
    built or loaded here. Thread-safe."""
    return _KERNEL.load()


# The K/V dtypes the kernel reads; the query is widened to float32, the output narrowed back.
# float8 e4m3fn and int8 caches hold packed rows with a float32 scale (engine.kv_cache.kv_quant).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
QUERY_DTYPES = (torch.float32, torch.bfloat16)
_ENTRY_POINTS = {torch.float32: "paged_decode_attention_f32", torch.bfloat16: "paged_decode_attention_bf16",
                 torch.int8: "paged_decode_attention_i8", torch.float8_e4m3fn: "paged_decode_attention_fp8"}


def paged_decode_attention_cpu(
    kernel: ctypes.CDLL,
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], float32 or bfloat16
    # [2, num_blocks, block_size, num_kv_heads, head_dim], float32 or bfloat16, or
    # [..., head_dim + 4] float8_e4m3fn / int8 packed rows; contiguous
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, >= ceil(max seq_len / block_size)], int64, rows contiguous
    seq_lens: torch.Tensor,  # [num_seqs], int64, >= 1
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim], the query's dtype
    """Attention of one query per sequence over its whole paged context, read in place.

    bfloat16 and 8-bit K/V are widened to float32 as they are read (an 8-bit row's scale
    multiplies its score, or its softmax weight for V); scores, softmax and the weighted sum
    accumulate in float32 whatever the dtype (a bfloat16 query is widened first, the output
    rounded to bfloat16 once at the end).

    The C code trusts what it is given: every shape the wrapper can check in O(1) is checked
    here, since a mismatch would read past a tensor rather than fail. The table's width and its
    block ids are the caller's to get right.

    Raises:
        ValueError: a tensor with another dtype, device, layout or shape than the above.
    """
    if query.dtype not in QUERY_DTYPES or kv_cache.dtype not in KV_DTYPES or query.device.type != "cpu":
        raise ValueError(f"a float32 or bfloat16 query and a float32, bfloat16, float8_e4m3fn or int8 cache on the "
                         f"CPU only, got {query.dtype} query and {kv_cache.dtype} cache on {query.device}")
    if not kv_cache.is_contiguous() or block_tables.dtype != torch.int64 or block_tables.stride(1) != 1 \
            or seq_lens.dtype != torch.int64:
        raise ValueError("kv_cache must be contiguous, block_tables and seq_lens int64 with contiguous rows")
    if query.dim() != 3 or kv_cache.dim() != 5 or query.shape[-1] != head_dim_of(kv_cache) \
            or query.shape[1] % kv_cache.shape[3]:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(kv_cache.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != query.shape[0] or seq_lens.shape != query.shape[:1]:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must have one row per query ({query.shape[0]})")
    out_dtype = query.dtype
    query = query.to(torch.float32).contiguous()
    seq_lens = seq_lens.contiguous()
    num_seqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty_like(query)
    fn = getattr(kernel, _ENTRY_POINTS[kv_cache.dtype])
    fn(
        query.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), num_seqs, num_heads, num_kv_heads,
        head_dim, block_size, scale, torch.get_num_threads(),
    )
    return out.to(out_dtype)


def paged_kv_write_cpu(
    kernel: ctypes.CDLL,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], heads contiguous, any token stride
    value: torch.Tensor,  # same
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], contiguous
    slot_mapping: torch.Tensor,  # [num_tokens], int64
) -> None:
    """:func:`engine.attention.write_kv` in one C call: token t's K and V rows into slot
    ``slot_mapping[t]`` of the cache (block ``slot // block_size``, row ``slot % block_size``).
    Mutates ``kv_cache``.

    Raises:
        ValueError: dtypes that differ from the cache's, rows of another shape or layout, a
            non-contiguous cache or slot mapping, or a slot outside the cache (nothing is written
            for those tokens; the others are).
    """
    row_shape = tuple(kv_cache.shape[3:])
    for name, t in (("key", key), ("value", value)):
        if t.dtype != kv_cache.dtype or t.device.type != "cpu" or t.dim() != 3 or tuple(t.shape[1:]) != row_shape \
                or t.stride(2) != 1 or t.stride(1) != row_shape[1] or t.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} strides {t.stride()} does not fit rows "
                             f"{row_shape} of a {kv_cache.dtype} cache for {slot_mapping.shape[0]} slots")
    if not kv_cache.is_contiguous() or slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("kv_cache must be contiguous and slot_mapping contiguous int64")
    size = kv_cache.element_size()
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    bad = kernel.paged_kv_write(key.data_ptr(), key.stride(0) * size, value.data_ptr(), value.stride(0) * size,
                                kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slot_mapping.data_ptr(),
                                slot_mapping.shape[0], row_shape[0] * row_shape[1] * size, num_slots)
    if bad:
        raise ValueError(f"{bad} of {slot_mapping.shape[0]} slots lie outside the cache's {num_slots}")


def paged_kv_write_q8_cpu(
    kernel: ctypes.CDLL,
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], float32, heads contiguous, any token stride
    value: torch.Tensor,  # same
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim + 4], float8_e4m3fn or int8
    slot_mapping: torch.Tensor,  # [num_tokens], int64
) -> None:
    """:func:`engine.attention.write_kv` on an 8-bit cache in one C call: each (token, head) row
    of ``key`` / ``value`` quantised into its packed row (values, float32 scale) at slot
    ``slot_mapping[t]``; the bytes equal :func:`engine.kv_cache.kv_quant.quantize_rows`'.
    Mutates ``kv_cache``.

    Raises:
        ValueError: float K/V that are not float32 CPU rows of the cache's heads, a cache that is
            not a contiguous 8-bit one, or a slot outside the cache (nothing is written for those
            tokens; the others are).
    """
    if not is_quantized(kv_cache) or not kv_cache.is_contiguous():
        raise ValueError(f"kv_cache must be a contiguous float8_e4m3fn or int8 cache, got {kv_cache.dtype}")
    num_kv_heads, head_dim = kv_cache.shape[3], head_dim_of(kv_cache)
    for name, t in (("key", key), ("value", value)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 3 \
                or tuple(t.shape[1:]) != (num_kv_heads, head_dim) or t.stride(2) != 1 or t.stride(1) != head_dim \
                or t.shape[0] != slot_mapping.shape[0]:
            raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} strides {t.stride()} does not fit float32 rows "
                             f"({num_kv_heads}, {head_dim}) for {slot_mapping.shape[0]} slots")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous int64")
    num_slots = kv_cache.shape[1] * kv_cache.shape[2]
    bad = kernel.paged_kv_write_q8(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                   kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slot_mapping.data_ptr(),
                                   slot_mapping.shape[0], num_kv_heads, head_dim, num_slots,
                                   int(kv_cache.dtype == torch.float8_e4m3fn))
    if bad:
        raise ValueError(f"{bad} of {slot_mapping.shape[0]} slots lie outside the cache's {num_slots}")


def paged_gather_q8_cpu(
    kernel: ctypes.CDLL,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim + 4], float8_e4m3fn or int8
    blocks: torch.Tensor,  # [>= ceil(ctx / block_size)], int64: the sequence's block ids in order
    ctx: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # K and V, each [ctx, num_kv_heads, head_dim] float32
    """The first ``ctx`` tokens' K and V rows of one sequence, dequantised in one C pass: equal to
    :func:`engine.kv_cache.kv_quant.dequantize_rows` of the gathered rows, bit for bit.

    Raises:
        ValueError: a cache that is not a contiguous 8-bit CPU one, a block list that is not
            contiguous int64 or too short for ``ctx``, or a block id outside the cache.
    """
    if not is_quantized(kv_cache) or not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        raise ValueError(f"kv_cache must be a contiguous float8_e4m3fn or int8 CPU cache, got {kv_cache.dtype}")
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if blocks.dtype != torch.int64 or blocks.dim() != 1 or not blocks.is_contiguous() \
            or blocks.shape[0] * block_size < ctx or ctx < 0:
        raise ValueError(f"blocks must be contiguous int64 covering {ctx} tokens, got {tuple(blocks.shape)} "
                         f"{blocks.dtype} of {block_size}-token blocks")
    used = blocks[: -(-ctx // block_size)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= num_blocks):
        raise ValueError(f"a block id outside the cache's {num_blocks} blocks")
    head_dim = head_dim_of(kv_cache)
    k = torch.empty(ctx, num_kv_heads, head_dim)
    v = torch.empty(ctx, num_kv_heads, head_dim)
    kernel.paged_gather_q8(kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), blocks.data_ptr(), ctx, block_size,
                           num_kv_heads, head_dim, int(kv_cache.dtype == torch.float8_e4m3fn), k.data_ptr(),
                           v.data_ptr())
    return k, v
