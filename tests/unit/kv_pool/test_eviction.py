"""High/low watermark LRU eviction, from plain ints: which blocks leave, in which order, how many."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from kv_pool.block_store import DUPLICATE, BlockEvent, BlockStore
from kv_pool.config import PoolConfig
from kv_pool.eviction import ON_DEMAND, Watermarks, num_bytes_to_evict, pick_victims
from kv_pool.lru import LruSet
from kv_pool.nvme_tier import NvmeTier
from tests.factories import stored_prefix

FP = "e" * 16
BLOCK_BYTES = 100
CAPACITY_BLOCKS = 10
HALF = Watermarks(high=0.9, low=0.5)  # evict when a write would pass 900 bytes, down to 500


def content(block_hash: int) -> BlockKey:
    return BlockKey.content(FP, block_hash)


def make_store(watermarks: Watermarks = HALF, nvme: NvmeTier | None = None) -> tuple[BlockStore, list[BlockEvent]]:
    events: list[BlockEvent] = []
    store = BlockStore(CAPACITY_BLOCKS * BLOCK_BYTES, on_event=events.append, nvme=nvme, watermarks=watermarks)
    return store, events


def put(store: BlockStore, block_hash: int) -> None:
    reservation = store.reserve(content(block_hash), BLOCK_BYTES)
    assert reservation is not DUPLICATE
    store.write(reservation, 0, bytes([block_hash % 256]) * BLOCK_BYTES)
    store.commit(reservation)


def hashes_of(events: list[BlockEvent], kind: str) -> list[int]:
    return [e.key.block_hash for e in events if e.kind == kind]


def test_arithmetic_of_the_watermarks():
    # Below high after the placement: only what does not fit.
    assert num_bytes_to_evict(800, 100, 1000, HALF) == 0
    assert num_bytes_to_evict(1000, 100, 1000, ON_DEMAND) == 100
    assert num_bytes_to_evict(900, 100, 1000, ON_DEMAND) == 0
    # Past high (900 + 100 > 900): down to low with the new block counted (1000 - 500).
    assert num_bytes_to_evict(900, 100, 1000, HALF) == 500
    lru = LruSet()
    for key, size in (("a", 100), ("b", 300), ("c", 100)):
        lru.add(key, size)
    assert pick_victims(lru, 350) == ["a", "b"]  # oldest first, until the bytes are covered
    assert list(lru._sizes) == ["c"] and lru.total_bytes == 100
    assert pick_victims(lru, 10_000) == ["c"] and not lru  # runs out: takes what there is


def test_crossing_high_evicts_lru_down_to_low():
    store, events = make_store()
    for h in range(9):
        put(store, h)  # 900 bytes: at the high watermark, not past it
    assert store.stats().num_evicted_blocks == 0
    store.get(content(0))  # 0 becomes most recently used
    put(store, 9)  # would be 1000 > 900: evict to 500 with block 9 counted
    stats = store.stats()
    assert hashes_of(events, "evicted") == [1, 2, 3, 4, 5]
    assert stats.num_evicted_blocks == 5 and stats.num_stored_blocks == 5 and stats.used_bytes == 500
    for h in (0, 6, 7, 8, 9):
        assert stored_prefix(store, FP, [content(h).block_hash]) == 1
    put(store, 10)  # 600 bytes: far below high, nothing more leaves
    assert store.stats().num_evicted_blocks == 5


def test_leased_and_writing_blocks_are_skipped():
    store, events = make_store()
    for h in range(6):
        put(store, h)
    assert store.lease([content(0), content(2)], "reader", 30.0) == 2
    writing = store.reserve(content(6), BLOCK_BYTES)  # mid-write, never committed here
    put(store, 7)
    put(store, 8)  # 900 bytes
    put(store, 9)  # past high: 500 bytes must go; candidates in LRU order are 1 3 4 5 7 8
    assert hashes_of(events, "evicted") == [1, 3, 4, 5, 7]
    stats = store.stats()
    assert stats.num_evicted_blocks == 5 and stats.used_bytes == 500
    assert stats.num_leased_blocks == 2 and stats.num_writing_blocks == 1
    store.write(writing, 0, b"\x06" * BLOCK_BYTES)
    store.commit(writing)  # the block mid-write is intact and commits
    assert store.get(content(6)) == b"\x06" * BLOCK_BYTES
    store.release_request("reader")
    assert store.stats().num_leased_blocks == 0


def test_low_watermark_not_reachable_evicts_every_evictable_block():
    store, events = make_store()
    for h in range(9):
        put(store, h)
    store.lease([content(h) for h in range(7)], "reader", 30.0)  # 700 bytes leased
    put(store, 9)  # wants 500 bytes out; only 7 and 8 may go
    assert hashes_of(events, "evicted") == [7, 8]
    assert store.stats().used_bytes == 800


def test_watermark_eviction_demotes_to_nvme(tmp_path):
    nvme = NvmeTier(str(tmp_path / "nvme"), 20 * BLOCK_BYTES)
    store, events = make_store(nvme=nvme)
    for h in range(10):
        put(store, h)
    stats = store.stats()
    assert hashes_of(events, "demoted") == [0, 1, 2, 3, 4] and hashes_of(events, "evicted") == []
    assert stats.num_nvme_demotions == 5 and stats.num_nvme_blocks == 5 and stats.num_dram_blocks == 5
    assert store.get(content(0)) == b"\x00" * BLOCK_BYTES  # promoted back: 600 bytes, no eviction
    assert store.stats().num_nvme_promotions == 1 and store.stats().num_evicted_blocks == 5
    store.close()


def test_on_demand_store_evicts_only_what_does_not_fit():
    store, events = make_store(ON_DEMAND)
    for h in range(11):
        put(store, h)
    assert hashes_of(events, "evicted") == [0]


@pytest.mark.parametrize(
    "high, low, message",
    [
        (1.5, 0.5, "high watermark must be in \\(0, 1\\], got 1.5"),
        (0.9, 0.0, "low watermark must be in \\(0, 1\\], got 0.0"),
        (0.8, 0.9, "low watermark 0.9 must not exceed the high watermark 0.8"),
    ],
)
def test_bad_watermarks_are_rejected_quoting_the_value(high, low, message):
    with pytest.raises(ValueError, match=message):
        Watermarks(high=high, low=low)
    with pytest.raises(ValueError, match=message):
        PoolConfig(evict_high_watermark=high, evict_low_watermark=low)


def test_pool_config_defaults():
    assert PoolConfig().watermarks == Watermarks(high=0.95, low=0.85)
