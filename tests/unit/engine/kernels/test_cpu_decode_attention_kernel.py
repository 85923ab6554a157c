"""The CPU paged decode kernel (C, ``engine/kernels/cpu/paged_decode_attention.c``) against the
readable reference, ``TorchAttentionBackend._decode`` (gather + SDPA with a length mask).

Every slot a sequence may not read (spare blocks, the tail of its last block, the blocks that
padding columns of the table point to) holds large garbage (|x| ~ 1e3): a kernel reading one
more key than the context would move the result by far more than the tolerance.
"""

from __future__ import annotations

import logging

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.cpu_attention import CpuAttentionBackend
from engine.kernels import cpu_build, cpu_decode_attention, cpu_prefill_attention
from engine.kernels.cpu_decode_attention import load_kernel, paged_decode_attention_cpu

# Both sides accumulate fp32 dot products and softmax in fp32, in different orders (the kernel
# uses a vector exp polynomial and sums in another order); max abs error of order 1e-6 for values of
# order 1.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
NUM_KV_HEADS = 2
GARBAGE = 1e3


def contexts(block_size: int, batch: int, gen: torch.Generator) -> list[int]:
    """Edge lengths first (1 token, exactly one and two blocks, one past a block, ragged), then
    random lengths up to ~5 blocks; ``batch`` of them."""
    edges = [1, block_size, 2 * block_size, block_size + 1, 3 * block_size + 5]
    if batch == 1:
        return [3 * block_size + 5]
    randoms = torch.randint(1, 5 * block_size + 7, (batch,), generator=gen).tolist()
    return (edges + randoms)[:batch]


def decode_batch(ctx_lens, group, head_dim, block_size, pad_columns=0, seed=0):
    """(query [n, H, D], kv_cache, meta) with each sequence on shuffled blocks; slots outside
    every context (and ``pad_columns`` extra table columns, pointing at spare blocks) hold
    garbage."""
    gen = torch.Generator().manual_seed(seed)
    n = len(ctx_lens)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=gen)
    spare = order[sum(blocks_per_seq):]
    width = max(blocks_per_seq) + pad_columns
    tables = spare[torch.randint(0, len(spare), (n, width), generator=gen)]  # padding: garbage blocks
    kv_cache = GARBAGE * torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen)
    used = 0
    for i, (ctx, nb) in enumerate(zip(ctx_lens, blocks_per_seq)):
        tables[i, :nb] = order[used : used + nb]
        used += nb
        for p in range(ctx):  # only the context's own slots hold values of order 1
            kv_cache[:, tables[i, p // block_size], p % block_size] /= GARBAGE
    query = torch.randn(n, NUM_KV_HEADS * group, head_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),  # unused by _decode
        query_start_loc=torch.arange(n + 1),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.long),
        block_tables=tables,
        max_query_len=1,
        max_seq_len=max(ctx_lens),
    )
    return query, kv_cache, meta


def reference(query, kv_cache, meta, scale):
    return TorchAttentionBackend._decode(query, kv_cache, meta, scale)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("block_size", [16, 1, 32])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("group", [1, 3, 8])

def test_kernel_matches_torch_decode(decode_kernel, group, head_dim, block_size, batch):
    gen = torch.Generator().manual_seed(batch * 1000 + block_size)
    ctx = contexts(block_size, batch, gen)
    query, kv_cache, meta = decode_batch(ctx, group, head_dim, block_size, seed=group + head_dim + block_size)
    scale = head_dim**-0.5
    out = paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables, meta.seq_lens, scale)
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(query, kv_cache, meta, scale), **FP32_TOL)


@pytest.mark.parametrize("block_size", [16, 1])
def test_padded_table_columns_are_not_read(decode_kernel, block_size):
    """Tables wider than any context (as the model runner pads them), padding on garbage blocks."""
    ctx = [1, block_size + 1, 2 * block_size, 3]
    query, kv_cache, meta = decode_batch(ctx, 3, 64, block_size, pad_columns=4, seed=7)
    out = paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, reference(query, kv_cache, meta, 0.125), **FP32_TOL)


@pytest.mark.parametrize("spread", [1.0, 10.0, 30.0])
def test_softmax_over_scores_far_apart(decode_kernel, spread):
    """The kernel's vector exp (Cephes' polynomial, clamped below at -87.3) against the
    reference's softmax when scores differ by hundreds (scores of standard deviation ~30 at spread 30): near-one-hot rows, rows where most
    terms underflow, and contexts whose length is not a multiple of the vector width (the tail).

    A score's rounding error grows with its magnitude (a float32 dot product whose terms are ~30x
    larger carries ~30x the absolute error, and exp turns it into that relative error of the
    weight), and the kernel sums in another order than torch (8 lanes on AVX2, 16 on AVX-512), so
    the bound grows with the spread past 10: 3e-5 at 30 (an AVX-512 Zen 4 measured 1.27e-5)."""
    ctx = [1, 15, 16, 17, 47, 130]
    query, kv_cache, meta = decode_batch(ctx, 3, 64, 16, seed=11)
    query = query * spread
    out = paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    grow = max(1.0, spread / 10.0)
    tol = dict(atol=FP32_TOL["atol"] * grow, rtol=FP32_TOL["rtol"] * grow)
    torch.testing.assert_close(out, reference(query, kv_cache, meta, 0.125), **tol)


def test_table_rows_sliced_from_a_wider_table(decode_kernel):
    """Rows contiguous but ``stride(0)`` larger than the width: a column slice of a wider table,
    starting at column 2 (what ``tables[:, 2:2 + w]`` gives)."""
    ctx = [17, 1, 40, 33]
    query, kv_cache, meta = decode_batch(ctx, 3, 64, 16, seed=3)
    width = meta.block_tables.shape[1]
    wide = torch.full((len(ctx), width + 5), 10**6, dtype=torch.long)  # out-of-range ids: must not be read
    wide[:, 2 : 2 + width] = meta.block_tables
    sliced = wide[:, 2 : 2 + width]
    assert not sliced.is_contiguous() and sliced.stride() == (width + 5, 1)
    out = paged_decode_attention_cpu(decode_kernel, query, kv_cache, sliced, meta.seq_lens, 0.125)
    torch.testing.assert_close(out, reference(query, kv_cache, meta, 0.125), **FP32_TOL)


def test_non_contiguous_query_and_seq_lens(decode_kernel):
    """The wrapper makes query and seq_lens contiguous itself."""
    ctx = [5, 16, 20]
    query, kv_cache, meta = decode_batch(ctx, 1, 64, 16, seed=4)
    strided_query = torch.randn(query.shape[0], query.shape[1], 2 * query.shape[2])[..., ::2]
    strided_query.copy_(query)
    strided_lens = torch.tensor([[c, 0] for c in ctx]).t()[0]
    assert not strided_query.is_contiguous() and not strided_lens.is_contiguous()
    out = paged_decode_attention_cpu(decode_kernel, strided_query, kv_cache, meta.block_tables, strided_lens, 0.125)
    torch.testing.assert_close(out, reference(query, kv_cache, meta, 0.125), **FP32_TOL)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_bfloat16_kv_matches_the_reference_on_the_same_blocks(decode_kernel, group, batch):
    """bfloat16 K/V widened exactly as read, float32 accumulation: against the reference run in
    float32 over the very same (bfloat16-rounded) blocks, the float32 tolerance holds; with a
    bfloat16 query the output is rounded once, so bfloat16's 2^-8 relative step bounds it."""
    gen = torch.Generator().manual_seed(batch + group)
    ctx = contexts(16, batch, gen)
    query, kv_cache, meta = decode_batch(ctx, group, 64, 16, pad_columns=2, seed=group)
    kv_bf16 = kv_cache.to(torch.bfloat16)
    expected = reference(query, kv_bf16.float(), meta, 0.125)
    out = paged_decode_attention_cpu(decode_kernel, query, kv_bf16, meta.block_tables, meta.seq_lens, 0.125)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, **FP32_TOL)
    q_bf16 = query.to(torch.bfloat16)
    out = paged_decode_attention_cpu(decode_kernel, q_bf16, kv_bf16, meta.block_tables, meta.seq_lens, 0.125)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(q_bf16.float(), kv_bf16.float(), meta, 0.125),
                               atol=1e-2, rtol=2**-8)


def test_rejects_float16(decode_kernel):
    query, kv_cache, meta = decode_batch([4], 1, 64, 16)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode_attention_cpu(decode_kernel, query.half(), kv_cache.half(), meta.block_tables, meta.seq_lens, 0.1)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_decode_attention_cpu(decode_kernel, query, kv_cache.half(), meta.block_tables, meta.seq_lens, 0.1)


def test_rejects_bad_layouts(decode_kernel):
    query, kv_cache, meta = decode_batch([4, 20], 1, 64, 16)
    strided_cache = torch.empty(2, kv_cache.shape[1], 16, 64, NUM_KV_HEADS).transpose(-1, -2)
    strided_cache.copy_(kv_cache)
    assert strided_cache.shape == kv_cache.shape and not strided_cache.is_contiguous()
    with pytest.raises(ValueError, match="contiguous"):
        paged_decode_attention_cpu(decode_kernel, query, strided_cache, meta.block_tables, meta.seq_lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables.int(), meta.seq_lens, 0.1)
    with pytest.raises(ValueError, match="int64"):
        paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables, meta.seq_lens.int(), 0.1)
    with pytest.raises(ValueError, match="contiguous rows"):  # column-major table
        paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables.t().contiguous().t(), meta.seq_lens, 0.1)


def test_rejects_shapes_that_would_read_past_a_tensor(decode_kernel):
    """The C code indexes by the shapes it is given: each of these read out of bounds (silently,
    or crashing on a huge garbage length) before the wrapper checked them."""
    query, kv_cache, meta = decode_batch([4, 20], 1, 64, 16)
    tables, lens = meta.block_tables, meta.seq_lens
    with pytest.raises(ValueError, match="does not fit"):  # 3 query heads over 2 KV heads
        paged_decode_attention_cpu(decode_kernel, torch.zeros(2, 3, 64), kv_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="does not fit"):  # head_dim 32 against a 64 cache
        paged_decode_attention_cpu(decode_kernel, query[..., :32].contiguous(), kv_cache, tables, lens, 0.1)
    with pytest.raises(ValueError, match="one row per query"):
        paged_decode_attention_cpu(decode_kernel, query, kv_cache, tables, lens[:1], 0.1)
    with pytest.raises(ValueError, match="one row per query"):
        paged_decode_attention_cpu(decode_kernel, query, kv_cache, tables[:1], lens, 0.1)


def test_compiles_into_the_cache_dir_once(decode_kernel, tmp_path, monkeypatch):
    """A fresh cache dir: compiled there on first use; a later start (no compiler at all) loads
    the same file instead of compiling again."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    fresh_kernel(monkeypatch)
    path = cpu_decode_attention.library_path()
    assert path.parent == tmp_path / "kernels" and not path.exists()
    first = load_kernel()
    assert first is not None and path.is_file()
    assert load_kernel() is first  # cached in the process
    assert list(path.parent.iterdir()) == [path]  # the temporary build folder is gone
    fresh_kernel(monkeypatch)  # a new process, say
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))  # compiling now would fail
    assert load_kernel() is not None


def test_without_a_compiler_returns_none_and_the_backend_falls_back(decode_kernel, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # empty: nothing compiled here yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    fresh_kernel(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert load_kernel() is None
    assert "unavailable" in caplog.text
    assert load_kernel() is None  # the failure is cached too: no second attempt per call
    assert not any(tmp_path.rglob("*.so"))

    fallback = CpuAttentionBackend()
    assert fallback._kernel is None and fallback._prefill_kernel is None
    ctx = [1, 16, 17, 40]
    query, kv_cache, meta = decode_batch(ctx, 3, 64, 16, pad_columns=2, seed=11)
    meta.slot_mapping = torch.tensor([int(meta.block_tables[i, (c - 1) // 16]) * 16 + (c - 1) % 16
                                      for i, c in enumerate(ctx)])
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[meta.slot_mapping]  # rewrites what is there
    value = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[meta.slot_mapping]
    got = fallback.forward(query, key, value, kv_cache.clone(), meta, 0.125)
    expected = reference(query, kv_cache, meta, 0.125)
    torch.testing.assert_close(got, expected, **FP32_TOL)
    with_kernel = paged_decode_attention_cpu(decode_kernel, query, kv_cache, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(got, with_kernel, **FP32_TOL)


def test_a_missing_kernel_source_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    """An install without the C source (package data left out) keeps gather + SDPA: no crash."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_decode_attention, "SOURCE", tmp_path / "cpu" / "paged_decode_attention.c")
    monkeypatch.setattr(cpu_prefill_attention, "SOURCE", tmp_path / "cpu" / "paged_prefill_attention.c")
    fresh_kernel(monkeypatch, cpu_decode_attention.SOURCE, cpu_prefill_attention.SOURCE)
    with pytest.raises(FileNotFoundError, match="not installed"):
        cpu_decode_attention.library_path()
    with caplog.at_level(logging.WARNING, logger=cpu_build.__name__):
        assert load_kernel() is None
    assert "unavailable" in caplog.text and "not installed" in caplog.text
    backend = CpuAttentionBackend()
    assert backend._kernel is None and backend._prefill_kernel is None
    assert not any(tmp_path.rglob("*.so"))

def test_a_shared_header_is_part_of_the_library_key_and_must_be_installed(tmp_path):
    """A kernel that includes a local header is compiled again when only the header changes (the
    library name is keyed by both), and refused clearly when the header is not installed."""
    source = tmp_path / "k.c"
    source.write_text('#include <stdint.h>\n#include "h.h"\nint f(void) { return VALUE; }\n')
    header = tmp_path / "h.h"
    header.write_text("#define VALUE 1\n")
    first = cpu_build.library_path(source)
    header.write_text("#define VALUE 2\n")
    assert cpu_build.library_path(source) != first
    header.unlink()
    with pytest.raises(FileNotFoundError, match="includes .*h.h, which is not installed"):
        cpu_build.library_path(source)


def fresh_kernel(monkeypatch, source=None, prefill_source=None) -> None:
    """The attention kernels as a new process finds them: not loaded yet (the decode kernel of
    ``source``, the prefill one of ``prefill_source``, default their own). The backend loads both,
    so a test that makes loading fail must not leave the prefill kernel's failure cached for the
    tests after it in this process."""
    for module, src in ((cpu_decode_attention, source), (cpu_prefill_attention, prefill_source)):
        kernel = module._KERNEL
        monkeypatch.setattr(module, "_KERNEL", cpu_build.CachedKernel(
            src or kernel.source, kernel.name, kernel.fallback, kernel.declare))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write_equals_write_kv_on_strided_views_of_the_fused_qkv(decode_kernel, dtype):
    """Keys and values as the model hands them over (views into the fused QKV output, token stride
    past the row); every other slot of the cache keeps its value."""
    from engine.attention import write_kv
    from engine.kernels.cpu_decode_attention import paged_kv_write_cpu

    gen = torch.Generator().manual_seed(7)
    num_blocks, block_size, kv_heads, head_dim, tokens = 6, 4, NUM_KV_HEADS, 8, 5
    qkv = torch.randn(tokens, (3 + 2) * kv_heads * head_dim, generator=gen).to(dtype)
    key = qkv[:, 3 * kv_heads * head_dim: 4 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    value = qkv[:, 4 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([5, 0, 23, 12, 13])
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    expected = cache.clone()
    write_kv(key, value, expected, slots)
    paged_kv_write_cpu(decode_kernel, key, value, cache, slots)
    assert torch.equal(cache, expected)


def test_kv_write_refuses_slots_outside_the_cache_and_mismatched_rows(decode_kernel):
    from engine.kernels.cpu_decode_attention import paged_kv_write_cpu

    cache = torch.zeros(2, 2, 4, NUM_KV_HEADS, 8)
    key = torch.ones(2, NUM_KV_HEADS, 8)
    with pytest.raises(ValueError, match="1 of 2 slots lie outside the cache's 8"):
        paged_kv_write_cpu(decode_kernel, key, key, cache, torch.tensor([3, 8]))
    assert cache[0].view(-1, NUM_KV_HEADS, 8)[3].eq(1).all()  # the valid slot was written
    with pytest.raises(ValueError, match="does not fit rows"):
        paged_kv_write_cpu(decode_kernel, key.double(), key, cache, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="does not fit rows"):
        paged_kv_write_cpu(decode_kernel, torch.ones(2, NUM_KV_HEADS, 4), key, cache, torch.tensor([0, 1]))
