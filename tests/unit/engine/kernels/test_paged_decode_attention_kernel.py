"""paged_decode_attention against TorchAttentionBackend's decode path."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.paged_decode_attention import paged_decode_attention

FP32_TOL = dict(atol=1e-4, rtol=1e-4)  # IEEE fp32 dot products; measured errors ~1e-6
FP16_TOL = dict(atol=1e-2, rtol=1e-2)  # fp16 inputs, fp32 accumulation, vs an fp32 reference
NUM_KV_HEADS = 2


def ragged_contexts(block_size: int) -> list[int]:
    # One token, exactly one block, one block + 1, several tiles of BLOCK_N=32 with a ragged end.
    return [1, block_size, block_size + 1, 3 * block_size + 5]


def run_decode(batch, scale, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))
    meta = batch.meta
    seq_lens = meta.seq_lens.to(batch.kv_cache.device)
    result = paged_decode_attention(
        batch.query, batch.kv_cache, meta.block_tables, seq_lens, meta.max_seq_len, scale, out=out, **kwargs
    )
    assert result is out
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_matches_torch(paged_batch, reference_attention, head_dim, group, block_size):
    ctx = ragged_contexts(block_size)
    batch = paged_batch([1] * len(ctx), ctx, NUM_KV_HEADS, group, head_dim, block_size, seed=head_dim + group)
    scale = head_dim**-0.5
    out = run_decode(batch, scale, num_splits=1, block_n=32)
    torch.testing.assert_close(out, reference_attention(batch, scale), **FP32_TOL)


@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("group", [1, 3])
def test_split_kv_matches_torch(paged_batch, reference_attention, group, num_splits):
    """Splits merged by log-sum-exp; short sequences leave later splits empty (weight 0)."""
    ctx = [1, 16, 17, 100]
    batch = paged_batch([1] * len(ctx), ctx, NUM_KV_HEADS, group, 64, 16, seed=num_splits)
    out = run_decode(batch, 0.125, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, reference_attention(batch, 0.125), **FP32_TOL)


def test_fp16(paged_batch, reference_attention):
    batch = paged_batch([1] * 3, [1, 16, 40], NUM_KV_HEADS, 3, 64, 16, dtype=torch.float16)
    out = run_decode(batch, 0.125, num_splits=1, block_n=32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), reference_attention(batch, 0.125), **FP16_TOL)


def test_rejects_group_mismatch(paged_batch):
    batch = paged_batch([1], [4], 2, 2, 64, 16)
    query = batch.query[:, :3]  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        paged_decode_attention(query, batch.kv_cache, batch.meta.block_tables, batch.meta.seq_lens, 4, 0.125)
