"""TritonAttentionBackend.forward (write + attend) against TorchAttentionBackend.forward."""

from __future__ import annotations

import pytest
import torch

from engine.attention import TorchAttentionBackend
from engine.triton_attention import TritonAttentionBackend

FP32_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "q_lens, ctx_lens",
    [
        ([1, 1, 1], [1, 17, 33]),  # all-decode step: the decode kernel
        ([6, 1, 4], [6, 17, 20]),  # prompt, decode row, chunk after a cached prefix
    ],
)
def test_forward_matches_torch_backend(paged_batch, q_lens, ctx_lens):
    # SmolLM2's attention shape: 9 query heads over 3 KV heads, head_dim 64.
    batch = paged_batch(q_lens, ctx_lens, 3, 3, 64, 16)
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(sum(q_lens), 3, 64, generator=gen).to(batch.kv_cache.device)
    value = torch.randn(sum(q_lens), 3, 64, generator=gen).to(batch.kv_cache.device)
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = TorchAttentionBackend().forward(batch.query, key, value, ref_cache, batch.meta, 0.125)
    out = TritonAttentionBackend().forward(batch.query, key, value, cache, batch.meta, 0.125)
    torch.testing.assert_close(cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(out, expected, **FP32_TOL)
