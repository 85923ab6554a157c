"""paged_prefill_attention against TorchAttentionBackend's mixed-step path."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.paged_prefill_attention import paged_prefill_attention

FP32_TOL = dict(atol=1e-4, rtol=1e-4)  # IEEE fp32 dot products; measured errors ~1e-6
FP16_TOL = dict(atol=1e-2, rtol=1e-2)  # fp16 inputs, fp32 accumulation, vs an fp32 reference
NUM_KV_HEADS = 2


def ragged_steps(block_size: int) -> tuple[list[int], list[int]]:
    """(q_lens, ctx_lens) of one mixed step::

        whole prompt of exactly one block   q = ctx = bs
        whole prompt of one block + 1       q = ctx = bs + 1
        chunk after a cached prefix         q = 5,  ctx = 2bs + 3  (2bs - 2 tokens not computed now)
        a decode row in the same step       q = 1,  ctx = bs + 1
        short prompt                        q = ctx = 3
    """
    q_lens = [block_size, block_size + 1, 5, 1, 3]
    ctx_lens = [block_size, block_size + 1, 2 * block_size + 3, block_size + 1, 3]
    return q_lens, ctx_lens


def run_prefill(batch, scale, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.meta
    dev = batch.kv_cache.device
    result = paged_prefill_attention(
        batch.query, batch.kv_cache, meta.block_tables, meta.query_start_loc.to(dev), meta.seq_lens.to(dev),
        meta.max_query_len, scale, out=out, **kwargs,
    )
    assert result is out
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_matches_torch(paged_batch, reference_attention, head_dim, group, block_size):
    q_lens, ctx_lens = ragged_steps(block_size)
    batch = paged_batch(q_lens, ctx_lens, NUM_KV_HEADS, group, head_dim, block_size, seed=head_dim + group)
    scale = head_dim**-0.5
    out = run_prefill(batch, scale, block_n=32)
    torch.testing.assert_close(out, reference_attention(batch, scale), **FP32_TOL)


@pytest.mark.parametrize("group", [1, 3])
def test_many_query_and_key_tiles(paged_batch, reference_attention, group):
    """block_m=16 gives 16 // group queries per tile (group 3: 5 queries, one padding row), so
    a 37-query chunk spans several query tiles, each stopping at its own causal edge."""
    batch = paged_batch([37, 2], [50, 40], NUM_KV_HEADS, group, 64, 16, seed=group)
    out = run_prefill(batch, 0.125, block_m=16, block_n=16)
    torch.testing.assert_close(out, reference_attention(batch, 0.125), **FP32_TOL)


def test_fp16(paged_batch, reference_attention):
    q_lens, ctx_lens = ragged_steps(16)
    batch = paged_batch(q_lens, ctx_lens, NUM_KV_HEADS, 3, 64, 16, dtype=torch.float16)
    out = run_prefill(batch, 0.125)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_attention(batch, 0.125), **FP16_TOL)
