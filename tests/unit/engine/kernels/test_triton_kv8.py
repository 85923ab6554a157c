"""The Triton kernels on 8-bit KV (``--kv-cache-dtype fp8|int8``): the quantising KV-cache write
against the reference quantisation byte for byte, and the paged decode and prefill kernels
against the torch reference on the same 8-bit blocks (run under the interpreter without CUDA)."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend, write_kv
from engine.kernels.kv_cache_write import kv_cache_write
from engine.kernels.paged_decode_attention import paged_decode_attention
from engine.kernels.paged_prefill_attention import paged_prefill_attention
from engine.kv_cache.kv_quant import allocate_kv_cache, quantize_rows

# fp32 dot products over dequantised values, the row scales applied to scores and weights
# instead of to each value: float32 rounding only.
FP32_TOL = dict(atol=1e-4, rtol=1e-4)
Q8 = [torch.float8_e4m3fn, torch.int8]
NUM_KV_HEADS = 2


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
def test_quantising_write_equals_the_reference_bytes(device, dtype):
    gen = torch.Generator().manual_seed(5)
    key = (torch.randn(7, NUM_KV_HEADS, 64, generator=gen) * torch.logspace(-4, 2, 7)[:, None, None]).to(device)
    value = torch.randn(7, NUM_KV_HEADS, 64, generator=gen).to(device)
    key[3, 1] = 0.0
    slots = torch.tensor([3, 0, -1, 8, 9, 30, 1], device=device)
    expected = allocate_kv_cache(1, 8, 4, NUM_KV_HEADS, 64, dtype, device)[0]
    got = expected.clone()
    keep = slots >= 0
    write_kv(key[keep], value[keep], expected, slots[keep])
    kv_cache_write(key, value, got, slots)
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def quantized_batch(paged_batch, dtype, q_lens, ctx_lens, group, head_dim, block_size, seed):
    batch = paged_batch(q_lens, ctx_lens, NUM_KV_HEADS, group, head_dim, block_size, seed=seed)
    return batch, quantize_rows(batch.kv_cache, dtype)


def torch_attention(batch, cache, scale):
    """The torch backend on ``cache`` (a copy): this step's K/V are the dequantised rows the
    cache already holds at their slots, which requantise to the same bytes."""
    from engine.kv_cache.kv_quant import dequantize_rows

    num_kv_heads, row = cache.shape[-2:]
    slots = batch.meta.slot_mapping
    k = dequantize_rows(cache[0].reshape(-1, num_kv_heads, row)[slots])
    v = dequantize_rows(cache[1].reshape(-1, num_kv_heads, row)[slots])
    return TorchAttentionBackend().forward(batch.query.float(), k, v, cache.clone(), batch.meta, scale)


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (3, 128)])
def test_decode_on_8bit_blocks_matches_the_reference(paged_batch, device, dtype, group, head_dim):
    ctx = [1, 16, 17, 53]
    batch, cache = quantized_batch(paged_batch, dtype, [1] * len(ctx), ctx, group, head_dim, 16, seed=group)
    out = paged_decode_attention(batch.query, cache, batch.meta.block_tables, batch.meta.seq_lens.to(device),
                                 batch.meta.max_seq_len, head_dim**-0.5, num_splits=1, block_n=16)
    torch.testing.assert_close(out, torch_attention(batch, cache, head_dim**-0.5), **FP32_TOL)


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
def test_split_decode_on_8bit_blocks_matches_the_reference(paged_batch, device, dtype):
    ctx = [1, 40, 70]
    batch, cache = quantized_batch(paged_batch, dtype, [1] * len(ctx), ctx, 3, 64, 16, seed=9)
    out = paged_decode_attention(batch.query, cache, batch.meta.block_tables, batch.meta.seq_lens.to(device),
                                 batch.meta.max_seq_len, 0.125, num_splits=3, block_n=16)
    torch.testing.assert_close(out, torch_attention(batch, cache, 0.125), **FP32_TOL)


@pytest.mark.parametrize("dtype", Q8, ids=["fp8", "int8"])
def test_prefill_on_8bit_blocks_matches_the_reference(paged_batch, device, dtype):
    """A first chunk, a chunk after cached context and a decode row in one step."""
    batch, cache = quantized_batch(paged_batch, dtype, [5, 3, 1], [5, 20, 9], 3, 64, 4, seed=2)
    meta = batch.meta
    out = paged_prefill_attention(batch.query, cache, meta.block_tables, meta.query_start_loc.to(device),
                                  meta.seq_lens.to(device), meta.max_query_len, 0.125, block_m=16, block_n=16)
    torch.testing.assert_close(out, torch_attention(batch, cache, 0.125), **FP32_TOL)
