"""kv_cache_write against engine.attention.write_kv."""

from __future__ import annotations

import pytest
import torch

from engine.attention import write_kv
from engine.kernels.kv_cache_write import kv_cache_write


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_matches_torch(device, head_dim, num_kv_heads, block_size):
    gen = torch.Generator().manual_seed(head_dim + num_kv_heads)
    num_blocks, num_tokens = 4, 21  # 21 tokens: two launch tiles, the second ragged
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(device)
    # K and V as column slices of one fused projection: non-contiguous token stride.
    kv = torch.randn(num_tokens, 2, num_kv_heads, head_dim, generator=gen).to(device)
    key, value = kv[:, 0], kv[:, 1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    expected = cache.clone()
    write_kv(key, value, expected, slots)
    # Poison the target slots: a token the kernel skips stays NaN.
    cache[0].view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    cache[1].view(-1, num_kv_heads, head_dim)[slots] = float("nan")
    kv_cache_write(key, value, cache, slots)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_layer_slice_of_full_cache_and_negative_slots(device):
    """The engine passes ``kv_cache[layer]``; slot -1 (padding) writes nothing."""
    full = torch.randn(3, 2, 4, 16, 2, 64).to(device)
    before = full.clone()
    key, value = torch.randn(3, 2, 64).to(device), torch.randn(3, 2, 64).to(device)
    slots = torch.tensor([5, -1, 63]).to(device)
    kv_cache_write(key, value, full[1], slots)
    expected = before.clone()
    write_kv(key[[0, 2]], value[[0, 2]], expected[1], slots[[0, 2]])
    torch.testing.assert_close(full, expected, atol=0, rtol=0)


def test_rejects_dtype_mismatch(device):
    cache = torch.zeros(2, 2, 16, 1, 64, device=device)
    key = torch.zeros(1, 1, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="dtype"):
        kv_cache_write(key, key, cache, torch.zeros(1, dtype=torch.long, device=device))
