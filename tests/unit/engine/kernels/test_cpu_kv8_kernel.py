"""The CPU kernels on 8-bit KV (``--kv-cache-dtype fp8|int8``): the quantising write against the
reference quantisation byte for byte, and the paged decode kernel against the torch reference on
the same 8-bit blocks; the CPU backend's mixed steps against the torch backend's."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, write_kv
from engine.cpu_attention import CpuAttentionBackend
from engine.kernels.cpu_decode_attention import paged_decode_attention_cpu, paged_gather_q8_cpu, paged_kv_write_q8_cpu
from engine.kv_cache.kv_quant import allocate_kv_cache, dequantize_rows, quantize_rows
from tests.unit.engine.kernels.test_cpu_decode_attention_kernel import contexts, decode_batch
from tests.unit.engine.test_cpu_attention_backend import make_step

# The kernel applies each row's scale to its score (K) or softmax weight (V) instead of to every
# value: the same products in another order, float32 rounding only.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
Q8 = [torch.float8_e4m3fn, torch.int8]


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
def test_quantising_write_equals_the_reference_bytes(decode_kernel, dtype):
    """Strided K/V (views of a fused QKV output), values over 6 orders of magnitude (e4m3
    subnormals included), a zero row, a skipped (negative) slot."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(9, 3 * 2 * 64 + 5, generator=gen) * torch.logspace(-4, 2, 9)[:, None]
    key = qkv[:, : 2 * 64].view(9, 2, 64)
    value = qkv[:, 2 * 64 : 4 * 64].view(9, 2, 64)
    key[2, 1] = 0.0
    slots = torch.tensor([3, 0, 17, 8, 9, 30, 31, 1, 2])
    expected = allocate_kv_cache(1, 8, 4, 2, 64, dtype, "cpu")[0]
    got = expected.clone()
    write_kv(key, value, expected, slots)
    paged_kv_write_q8_cpu(decode_kernel, key, value, got, slots)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def test_quantising_write_refuses_a_float_cache_and_slots_outside(decode_kernel):
    key = torch.randn(2, 2, 64)
    with pytest.raises(ValueError, match="kv_cache must be a contiguous float8_e4m3fn or int8 cache"):
        paged_kv_write_q8_cpu(decode_kernel, key, key, torch.zeros(2, 4, 4, 2, 64), torch.tensor([0, 1]))
    cache = allocate_kv_cache(1, 4, 4, 2, 64, torch.int8, "cpu")[0]
    with pytest.raises(ValueError, match="1 of 2 slots lie outside the cache's 16"):
        paged_kv_write_q8_cpu(decode_kernel, key, key, cache, torch.tensor([0, 16]))


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize("block_size,batch", [(16, 16), (1, 4), (32, 1)])
def test_decode_kernel_on_8bit_blocks_matches_the_reference(decode_kernel, dtype, head_dim, block_size, batch):
    """Same 8-bit blocks for both sides; garbage (|x| ~ 1e3) everywhere a sequence may not read."""
    gen = torch.Generator().manual_seed(batch + block_size)
    ctx = contexts(block_size, batch, gen)
    query, kv_cache, meta = decode_batch(ctx, 3, head_dim, block_size, seed=head_dim + block_size)
    cache = quantize_rows(kv_cache, dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention_cpu(decode_kernel, query, cache, meta.block_tables, meta.seq_lens, scale)
    expected = TorchAttentionBackend._decode(query, cache, meta, scale)
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "sdpa"])
def test_cpu_backend_mixed_step_on_8bit_cache_matches_the_torch_backend(decode_kernel, dtype, use_kernel):
    """Decode rows, a first prompt chunk (nothing cached) and a chunk after cached context in one
    step; both backends write the same quantised rows (bitwise equal caches afterwards)."""
    step = make_step([1, 5, 1, 3], [9, 5, 14, 11], seed=4)
    cache = quantize_rows(step.kv_cache, dtype)
    ours, theirs = cache.clone(), cache.clone()
    out = CpuAttentionBackend(use_kernel).forward(step.query, step.key, step.value, ours, step.meta, 0.125)
    expected = TorchAttentionBackend().forward(step.query, step.key, step.value, theirs, step.meta, 0.125)
    assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
    torch.testing.assert_close(out, expected, **FP32_TOL)


@pytest.mark.parametrize("head_dim", [64, 80], ids=["vector", "scalar"])
def test_decode_kernel_widens_every_fp8_code_exactly(decode_kernel, head_dim):
    """Every finite e4m3 code (subnormals, zeros of both signs, +-448) as a V value of a
    one-token context: the softmax weight is 1, so each output is the code's value times its
    row's scale, exactly (the vector path widens through float16 and folds 2^8 into the scale)."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    num_seqs = -(-len(codes) // head_dim)
    values = torch.zeros(num_seqs * head_dim, dtype=torch.uint8)
    values[: len(codes)] = codes
    cache = allocate_kv_cache(1, num_seqs, 1, 1, head_dim, torch.float8_e4m3fn, "cpu")[0]
    rows = cache.view(torch.uint8)  # [2, num_seqs, 1, 1, head_dim + 4]
    rows[..., :head_dim] = values.view(num_seqs, 1, 1, head_dim)
    scales = torch.tensor([0.5, 3.0, 2.0**-10, 1.0, 7.0])[:num_seqs]
    rows[..., head_dim:] = scales.view(torch.uint8).view(1, num_seqs, 1, 1, 4)
    query = torch.randn(num_seqs, 1, head_dim)
    out = paged_decode_attention_cpu(decode_kernel, query, cache, torch.arange(num_seqs).view(-1, 1),
                                     torch.ones(num_seqs, dtype=torch.int64), head_dim**-0.5)
    expected = values.view(torch.float8_e4m3fn).float().view(num_seqs, head_dim) * scales[:, None]
    assert torch.equal(out[:, 0], expected)


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
@pytest.mark.parametrize("head_dim", [64, 80], ids=["vector", "scalar"])
def test_gather_dequantises_a_sequence_like_the_reference(decode_kernel, dtype, head_dim):
    """Scattered blocks, a context ending mid-block, values over 6 orders of magnitude: bit for bit
    the rows kv_quant.dequantize_rows makes of index_select's gather; bad block lists refused."""
    gen = torch.Generator().manual_seed(5)
    values = torch.randn(2, 9, 4, 3, head_dim, generator=gen) * torch.logspace(-4, 2, 9)[None, :, None, None, None]
    cache = quantize_rows(values, dtype)
    blocks = torch.tensor([7, 2, 5, 0])
    k, v = paged_gather_q8_cpu(decode_kernel, cache, blocks, 14)
    for got, plane in ((k, cache[0]), (v, cache[1])):
        rows = plane.index_select(0, blocks).view(-1, 3, head_dim + 4)[:14]
        assert torch.equal(got, dequantize_rows(rows))
    with pytest.raises(ValueError, match="covering 17 tokens"):
        paged_gather_q8_cpu(decode_kernel, cache, blocks, 17)
    with pytest.raises(ValueError, match="outside the cache's 9 blocks"):
        paged_gather_q8_cpu(decode_kernel, cache, torch.tensor([1, 9]), 5)
