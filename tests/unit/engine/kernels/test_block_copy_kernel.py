"""gather_blocks / scatter_blocks against the torch pack/unpack of engine.kv_connector."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.block_copy import gather_blocks, scatter_blocks
from engine.kv_connector import pack_blocks, unpack_blocks


def make_cache(device, block_size, dtype=torch.float32, num_layers=3, num_blocks=6, num_kv_heads=3, head_dim=64):
    gen = torch.Generator().manual_seed(block_size)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_gather_matches_torch(device, block_size, dtype):
    cache = make_cache(device, block_size, dtype)
    ids = torch.tensor([4, 0, 5], device=device)
    expected = cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5)
    out = torch.full(expected.shape, float("nan"), dtype=dtype, device=device)
    assert gather_blocks(cache, ids, out=out) is out
    torch.testing.assert_close(out, expected, atol=0, rtol=0)


@pytest.mark.parametrize("block_size", [16, 32])
def test_scatter_matches_torch(device, block_size):
    cache = make_cache(device, block_size)
    ids = torch.tensor([2, 5], device=device)
    staging = torch.randn(2, *cache[:, :, 0].shape).to(device)
    expected = cache.clone()
    expected.index_copy_(2, ids, staging.permute(1, 2, 0, 3, 4, 5))
    cache[:, :, ids] = float("nan")  # poisoned: a target element left unwritten fails
    scatter_blocks(cache, ids, staging)
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


def test_round_trip_through_connector_bytes(device):
    """Kernel staging bytes equal kv_connector's per-block payloads, and unpack restores them."""
    cache = make_cache(device, 16)
    ids = [3, 1]
    staged = gather_blocks(cache, torch.tensor(ids, device=device)).cpu()
    payloads = pack_blocks(cache, ids)
    assert [staged[i].numpy().tobytes() for i in range(2)] == payloads
    restored = torch.zeros_like(cache)
    unpack_blocks(restored, ids, payloads)
    torch.testing.assert_close(restored[:, :, ids], cache[:, :, ids], atol=0, rtol=0)


def test_rejects_non_contiguous_cache(device):
    cache = make_cache(device, 16).transpose(0, 1)
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks(cache, torch.tensor([0], device=device))
