"""DRAM arena slots and the NVMe tier under the block store: demotion, promotion, per-tier stats."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from kv_pool.arena import Arena, ExtentAllocator
from kv_pool.block_store import DUPLICATE, BlockEvent, BlockStore, PoolFullError
from kv_pool.nvme_tier import NvmeTier
from tests.factories import stored_prefix

FP = "f" * 16
BLOCK_BYTES = 1000


def content(block_hash: int) -> BlockKey:
    return BlockKey.content(FP, block_hash)


def payload(seed: int) -> bytes:
    return bytes((seed * 7 + i) % 251 for i in range(BLOCK_BYTES))


def put(store: BlockStore, key: BlockKey, seed: int, checksum: int = 0) -> None:
    reservation = store.reserve(key, BLOCK_BYTES, checksum)
    assert reservation is not DUPLICATE
    store.write(reservation, 0, payload(seed))
    store.commit(reservation)


def make_store(tmp_path, dram_blocks: int, nvme_blocks: int) -> tuple[BlockStore, list[BlockEvent]]:
    events: list[BlockEvent] = []
    arena = Arena(dram_blocks * BLOCK_BYTES, str(tmp_path / "arena"))
    nvme = NvmeTier(str(tmp_path / "nvme"), nvme_blocks * BLOCK_BYTES) if nvme_blocks else None
    return BlockStore(dram_blocks * BLOCK_BYTES, on_event=events.append, arena=arena, nvme=nvme), events


def test_extent_allocator_first_fit_and_coalescing():
    alloc = ExtentAllocator(100)
    a, b, c = alloc.allocate(30), alloc.allocate(30), alloc.allocate(30)
    assert (a, b, c, alloc.allocate(20), alloc.free_bytes) == (0, 30, 60, None, 10)
    alloc.free(a, 30)
    alloc.free(c, 30)
    assert alloc.allocate(50) is None  # 30 + 40 free, but not contiguous
    alloc.free(b, 30)  # merges both neighbours into one extent
    assert (alloc.allocate(100), alloc.free_bytes) == (0, 0)


def test_arena_file_holds_the_committed_bytes(tmp_path):
    store, _ = make_store(tmp_path, dram_blocks=2, nvme_blocks=0)
    put(store, content(1), seed=1)
    [location] = store.locate([content(1)], "req-a", ttl_s=5)
    with open(tmp_path / "arena", "rb") as f:  # what a same-host worker maps
        f.seek(location.offset_bytes)
        assert f.read(location.block_bytes) == payload(1)
    store.release_request("req-a")
    store.close()
    assert not (tmp_path / "arena").exists()


def test_dram_eviction_demotes_to_nvme_and_a_hit_promotes_byte_identical(tmp_path):
    store, events = make_store(tmp_path, dram_blocks=2, nvme_blocks=4)
    for h in (1, 2, 3):
        put(store, content(h), seed=h, checksum=100 + h)
    assert events[-2:] == [BlockEvent("demoted", content(1)), BlockEvent("stored", content(3))]
    stats = store.stats()
    assert (stats.num_stored_blocks, stats.num_nvme_blocks, stats.num_nvme_demotions) == (2, 1, 1)
    assert stored_prefix(store, FP, [1, 2, 3]) == 3  # NVMe blocks count as stored

    assert store.get(content(1)) == payload(1)  # read back, promoted; 2 is now the LRU in DRAM
    assert store.checksum(content(1)) == 101
    assert events[-2:] == [BlockEvent("demoted", content(2)), BlockEvent("stored", content(1))]
    stats = store.stats()
    assert (stats.num_nvme_promotions, stats.num_nvme_demotions, stats.num_nvme_blocks) == (1, 2, 1)
    assert store.get(content(2)) == payload(2) and store.get(content(3)) == payload(3)
    store.close()


def test_nvme_full_drops_its_lru_and_duplicates_see_both_tiers(tmp_path):
    store, events = make_store(tmp_path, dram_blocks=1, nvme_blocks=2)
    for h in (1, 2, 3, 4):
        put(store, content(h), seed=h)
    # DRAM holds 4; NVMe held 1, 2, then 3 pushed 1 out of the node.
    assert BlockEvent("evicted", content(1)) in events
    assert stored_prefix(store, FP, [1]) == 0 and stored_prefix(store, FP, [2, 3, 4]) == 3
    assert store.reserve(content(2), BLOCK_BYTES) is DUPLICATE  # on NVMe: no second copy
    stats = store.stats()
    assert (stats.num_nvme_evictions, stats.num_nvme_blocks, stats.nvme_used_bytes) == (1, 2, 2 * BLOCK_BYTES)
    assert (stats.num_nvme_hits, stats.num_nvme_misses) == (0, 0)  # no block was read or leased yet
    store.close()


def test_lease_promotes_and_leased_blocks_are_never_demoted(tmp_path):
    store, _ = make_store(tmp_path, dram_blocks=2, nvme_blocks=4)
    for h in (1, 2, 3):
        put(store, content(h), seed=h)
    assert len(store.locate([BlockKey.content(FP, h) for h in (1, 2)], "req-a", ttl_s=5)) == 2  # 1 came back from NVMe
    with pytest.raises(PoolFullError):
        store.reserve(content(4), BLOCK_BYTES)  # both DRAM slots leased
    assert len(store.locate([BlockKey.content(FP, h) for h in (3,)], "req-b", ttl_s=5)) == 0  # no room to promote: not leased
    assert store.get(content(3)) == payload(3)  # still readable in place from NVMe
    store.release_request("req-a")
    put(store, content(4), seed=4)  # 1 is the LRU now: demoted
    assert store.get(content(1)) == payload(1)
    stats = store.stats()
    assert (stats.num_leases, stats.num_leased_blocks, stats.num_writing_blocks) == (0, 0, 0)
    store.close()


def test_drop_corrupt_removes_from_either_tier(tmp_path):
    store, events = make_store(tmp_path, dram_blocks=1, nvme_blocks=2)
    put(store, content(1), seed=1)
    put(store, content(2), seed=2)  # 1 on NVMe
    store.lease([content(2)], "req-a", ttl_s=5)
    assert store.drop_corrupt(content(2)) and store.drop_corrupt(content(1))
    assert not store.drop_corrupt(content(1))
    stats = store.stats()
    assert (stats.num_corrupt_blocks, stats.num_stored_blocks, stats.num_nvme_blocks) == (2, 0, 0)
    assert (stats.num_leases, stats.num_leased_blocks) == (0, 0)
    assert events[-2:] == [BlockEvent("evicted", content(2)), BlockEvent("evicted", content(1))]
    store.close()
