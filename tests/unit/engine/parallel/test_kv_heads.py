"""Whole pool blocks cut into each rank's KV heads and joined back, byte for byte."""

from __future__ import annotations

import torch

from engine.kv_connector import pack_blocks
from engine.parallel.layout import ShardLayout
from engine.parallel.runner import head_slice, join_heads

# [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], float32.
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 2, 5, 4, 8


def block_shape(num_kv_heads: int) -> tuple[int, ...]:
    return (NUM_LAYERS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM * 4)


def rank_caches(full: torch.Tensor, layout_of_rank) -> list[torch.Tensor]:
    return [full[..., layout_of_rank(r).kv_heads(), :].contiguous() for r in range(layout_of_rank(0).tp)]


def test_cutting_a_block_gives_each_rank_exactly_its_heads():
    full = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_DIM)
    layout = ShardLayout(0, 2, 9, 3, 16, 32)
    [block] = pack_blocks(full, [3])
    for rank, heads in ((0, [0, 1]), (1, [2])):
        cut = head_slice(block, layout, block_shape(3), rank)
        assert cut == pack_blocks(full[..., heads, :].contiguous(), [3])[0]
        assert len(cut) == len(block) * len(heads) // 3


def test_joining_the_ranks_heads_gives_the_tp1_block():
    full = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_DIM)
    layouts = [ShardLayout(r, 2, 9, 3, 16, 32) for r in range(2)]
    caches = rank_caches(full, lambda r: layouts[r])
    parts = [pack_blocks(cache, [4, 0, 2]) for cache in caches]
    assert join_heads(parts, layouts[0], block_shape(3)) == pack_blocks(full, [4, 0, 2])


def test_replicated_heads_are_taken_from_their_first_holder():
    full = torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 2, HEAD_DIM)
    layouts = [ShardLayout(r, 4, 8, 2, 16, 32) for r in range(4)]
    caches = rank_caches(full, lambda r: layouts[r])
    caches[1].fill_(7.0)  # a replica holding garbage must not be read (rank 0 owns head 0)
    caches[3].fill_(7.0)
    parts = [pack_blocks(cache, [1]) for cache in caches]
    assert join_heads(parts, layouts[0], block_shape(2)) == pack_blocks(full, [1])
    [block] = pack_blocks(full, [1])
    assert head_slice(block, layouts[0], block_shape(2), 1) == pack_blocks(caches[0], [1])[0]


def test_8bit_blocks_are_cut_by_heads_with_their_scales():
    """An int8 block's head rows are HEAD_DIM values and a 4-byte scale: each rank's cut holds its
    heads' rows whole, and joining them gives the TP=1 block."""
    from engine.kv_cache.kv_quant import quantize_rows

    full = quantize_rows(torch.randn(NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, 3, HEAD_DIM), torch.int8)
    shape = (NUM_LAYERS, 2, BLOCK_SIZE, 3, full.shape[-1] * full.element_size())  # as TensorParallelRunner
    assert shape[-1] == HEAD_DIM + 4
    layouts = [ShardLayout(r, 2, 9, 3, 16, 32) for r in range(2)]
    [block] = pack_blocks(full, [3])
    for rank, heads in ((0, [0, 1]), (1, [2])):
        assert head_slice(block, layouts[rank], shape, rank) == pack_blocks(full[..., heads, :].contiguous(), [3])[0]
    caches = rank_caches(full, lambda r: layouts[r])
    parts = [pack_blocks(cache, [4, 0, 2]) for cache in caches]
    assert join_heads(parts, layouts[0], shape) == pack_blocks(full, [4, 0, 2])
