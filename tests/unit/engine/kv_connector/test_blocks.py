"""KV connector: blocks packed from a cache and loaded back, from bytes and from mapped-arena views."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from engine.kv_connector import ArenaBlock, LoadGuard, pack_blocks, unpack_blocks

# [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], fp32
SHAPE = (3, 2, 6, 4, 2, 8)
BLOCK_BYTES = 3 * 2 * 4 * 2 * 8 * 4


def arena_with(payloads: list[bytes], order: list[int]) -> tuple[mmap.mmap, list[int]]:
    """An anonymous shared mapping holding ``payloads`` in slots ``order`` (a stand-in arena)."""
    arena = mmap.mmap(-1, BLOCK_BYTES * (max(order) + 1))
    for payload, slot in zip(payloads, order):
        arena[slot * BLOCK_BYTES : (slot + 1) * BLOCK_BYTES] = payload
    return arena, [slot * BLOCK_BYTES for slot in order]


def test_arena_views_and_bytes_load_byte_identical_and_release_once():
    source = torch.randn(SHAPE)
    payloads = pack_blocks(source, [4, 0, 5, 2])
    arena, offsets = arena_with(payloads[:3], [2, 0, 1])
    view = memoryview(arena)
    calls = []
    guard = LoadGuard(lambda: calls.append("done"))
    mapped = [ArenaBlock.wrap(view[o : o + BLOCK_BYTES], guard) for o in offsets]
    assert [len(b) for b in mapped] == [BLOCK_BYTES] * 3 and bytes(mapped[1]) == payloads[1]

    cache = torch.zeros(SHAPE)
    unpack_blocks(cache, [1, 3, 0, 5], [*mapped, payloads[3]])  # three views and one bytes payload
    for dst, src in zip((1, 3, 0, 5), (4, 0, 5, 2)):
        assert torch.equal(cache[:, :, dst], source[:, :, src])
    assert torch.count_nonzero(cache[:, :, [2, 4]]) == 0
    assert calls == ["done"] and not guard.alive
    del mapped, guard
    gc.collect()
    assert calls == ["done"]  # not again when the views go


def test_views_dropped_without_a_copy_run_the_guard():
    arena, [offset] = arena_with([bytes(BLOCK_BYTES)], [0])
    calls = []
    block = ArenaBlock.wrap(memoryview(arena)[offset : offset + BLOCK_BYTES], LoadGuard(lambda: calls.append(1)))
    assert calls == []
    del block
    assert calls == [1]


def test_wrong_sizes_are_refused_and_the_guard_still_runs():
    arena, [offset] = arena_with([bytes(BLOCK_BYTES)], [0])
    calls = []
    guard = LoadGuard(lambda: calls.append(1))
    block = ArenaBlock.wrap(memoryview(arena)[offset : offset + BLOCK_BYTES], guard)
    with pytest.raises(ValueError, match="2 block ids for 1 payloads"):
        unpack_blocks(torch.zeros(SHAPE), [0, 1], [block])
    with pytest.raises(ValueError, match=f"payload of 10 bytes, a block is {BLOCK_BYTES}"):
        unpack_blocks(torch.zeros(SHAPE), [0], [b"x" * 10])
    unpack_blocks(torch.zeros(SHAPE), [0], [block])
    assert calls == [1]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.int8], ids=["fp8", "int8"])
def test_8bit_blocks_move_with_their_scales(dtype):
    """An 8-bit cache's block is its packed rows, scales included: the spec's block_bytes per
    payload, loaded back byte for byte, and a copy-on-write copy carries the scales too."""
    from core.kv_cache_spec import KVCacheSpec
    from engine.kv_cache.kv_quant import dequantize_rows, quantize_rows

    floats = torch.randn(3, 2, 6, 4, 2, 8)
    source = quantize_rows(floats, dtype)  # [3, 2, 6, 4, 2, 8 + 4]
    spec = KVCacheSpec("m", "r", "float32", 3, 2, 8, 4, kv_cache_dtype="fp8" if dtype == torch.float8_e4m3fn else "int8")
    payloads = pack_blocks(source, [4, 0])
    assert [len(p) for p in payloads] == [spec.block_bytes] * 2 == [3 * 2 * 4 * 2 * (8 + 4)] * 2
    cache = torch.zeros_like(source)
    unpack_blocks(cache, [1, 3], payloads)
    assert torch.equal(cache[:, :, [1, 3]].view(torch.uint8), source[:, :, [4, 0]].view(torch.uint8))
    cache[:, :, 5] = cache[:, :, 1]  # the model runner's copy-on-write copy
    assert torch.equal(dequantize_rows(cache[:, :, 5]), dequantize_rows(source[:, :, 4]))
    with pytest.raises(ValueError, match=f"payload of {spec.block_bytes - 1} bytes, a block is {spec.block_bytes}"):
        unpack_blocks(cache, [0], [payloads[0][1:]])
