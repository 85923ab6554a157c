"""BlockStore from plain ints and bytes: visibility, rollback, dedup, LRU, leases, scoped blocks."""

from __future__ import annotations

import dataclasses

import pytest

from core.block_key import BlockKey
from kv_pool.block_store import (
    DUPLICATE,
    BlockEvent,
    BlockState,
    BlockStore,
    PoolFullError,
    StaleReservationError,
)
from tests.factories import stored_prefix

FP = "f" * 16
BLOCK_BYTES = 100


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def content(block_hash: int) -> BlockKey:
    return BlockKey.content(FP, block_hash)


def scoped(request_id: str, block_index: int = 0) -> BlockKey:
    return BlockKey.scoped(FP, request_id, block_index)


def payload(seed: int) -> bytes:
    return bytes((seed + i) % 256 for i in range(BLOCK_BYTES))


def make_store(capacity_blocks: int = 8, ttl_s: float = 10.0) -> tuple[BlockStore, FakeClock, list[BlockEvent]]:
    clock, events = FakeClock(), []
    store = BlockStore(capacity_blocks * BLOCK_BYTES, default_ttl_s=ttl_s, clock=clock, on_event=events.append)
    return store, clock, events


def put(store: BlockStore, key: BlockKey, seed: int = 0) -> bool:
    """Two-phase put in two chunks; returns False when the store answered DUPLICATE."""
    reservation = store.reserve(key, BLOCK_BYTES)
    if reservation is DUPLICATE:
        return False
    data = payload(seed)
    store.write(reservation, 0, data[:40])
    store.write(reservation, 40, memoryview(data)[40:])
    store.commit(reservation)
    return True


def held(store: BlockStore, hashes: range) -> list[int]:
    return [h for h in hashes if store.block_state(content(h)) is BlockState.STORED]


def assert_idle(store: BlockStore, num_stored_blocks: int) -> None:
    """Every count is back to zero except the committed content blocks (the prefix cache)."""
    stats = dataclasses.asdict(store.stats())
    for name in ("num_writing_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases"):
        assert stats[name] == 0, (name, stats)
    assert stats["num_stored_blocks"] == num_stored_blocks, stats
    assert stats["used_bytes"] == num_stored_blocks * BLOCK_BYTES, stats


def test_writing_block_is_invisible_until_commit():
    store, _, events = make_store()
    reservation = store.reserve(content(1), BLOCK_BYTES)
    store.write(reservation, 0, payload(7))
    assert stored_prefix(store, FP, [1]) == 0
    with pytest.raises(KeyError):
        store.get(content(1))
    assert store.block_state(content(1)) is BlockState.WRITING
    assert store.stats().num_writing_blocks == 1 and store.stats().used_bytes == BLOCK_BYTES
    assert events == []

    store.commit(reservation)
    assert stored_prefix(store, FP, [1]) == 1
    assert bytes(store.get(content(1))) == payload(7)
    assert events == [BlockEvent("stored", content(1))]
    assert_idle(store, num_stored_blocks=1)


def test_abort_rolls_back_and_leaves_nothing():
    store, _, events = make_store()
    reservation = store.reserve(content(1), BLOCK_BYTES)
    store.write(reservation, 0, payload(0)[:50])
    assert store.abort(reservation) is True
    assert store.block_state(content(1)) is None
    assert stored_prefix(store, FP, [1]) == 0
    assert store.abort(reservation) is False  # a second abort is harmless
    with pytest.raises(StaleReservationError):
        store.write(reservation, 50, payload(0)[50:])
    with pytest.raises(StaleReservationError):
        store.commit(reservation)
    assert events == []
    assert_idle(store, num_stored_blocks=0)


def test_write_rejects_gaps_overflow_and_early_commit():
    store, _, _ = make_store()
    reservation = store.reserve(content(1), BLOCK_BYTES)
    with pytest.raises(ValueError, match="offset 10, expected 0"):
        store.write(reservation, 10, b"x")
    with pytest.raises(ValueError, match="past block_bytes"):
        store.write(reservation, 0, bytes(BLOCK_BYTES + 1))
    store.write(reservation, 0, bytes(BLOCK_BYTES - 1))
    with pytest.raises(ValueError, match="99 of 100"):
        store.commit(reservation)
    store.abort(reservation)
    with pytest.raises(ValueError, match="block_bytes must be > 0"):
        store.reserve(content(2), 0)
    with pytest.raises(ValueError, match="spec_fingerprint"):
        store.reserve(BlockKey.content("", 2), BLOCK_BYTES)
    assert_idle(store, num_stored_blocks=0)


def test_duplicate_put_stores_one_copy():
    store, _, events = make_store()
    assert put(store, content(1), seed=1) is True
    assert put(store, content(1), seed=2) is False
    assert bytes(store.get(content(1))) == payload(1)  # the first copy stays
    assert [e.kind for e in events] == ["stored"]
    assert_idle(store, num_stored_blocks=1)


def test_concurrent_writers_of_one_hash_make_one_copy():
    store, _, _ = make_store()
    first = store.reserve(content(1), BLOCK_BYTES)
    assert store.reserve(content(1), BLOCK_BYTES) is DUPLICATE  # second writer skips its bytes
    assert store.stats().used_bytes == BLOCK_BYTES
    store.write(first, 0, payload(3))
    store.commit(first)
    assert bytes(store.get(content(1))) == payload(3)
    assert_idle(store, num_stored_blocks=1)


def test_lru_evicts_least_recently_used_first():
    store, _, events = make_store(capacity_blocks=3)
    for h in (1, 2, 3):
        put(store, content(h))
    store.get(content(1))  # 1 becomes most recently used: order is 2, 3, 1
    put(store, content(4))
    assert held(store, range(1, 6)) == [1, 3, 4]
    put(store, content(5))
    assert held(store, range(1, 6)) == [1, 4, 5]
    assert [(e.kind, e.key.block_hash) for e in events if e.kind == "evicted"] == [("evicted", 2), ("evicted", 3)]
    assert store.stats().num_evicted_blocks == 2
    assert_idle(store, num_stored_blocks=3)


def test_leased_block_is_never_evicted():
    store, _, _ = make_store(capacity_blocks=2)
    put(store, content(1))
    put(store, content(2))
    assert store.lease([content(1)], "req-a", ttl_s=5) == 1
    put(store, content(3))  # 1 is least recently used but leased: 2 goes
    assert held(store, range(1, 5)) == [1, 3]

    store.lease([content(3)], "req-a", ttl_s=5)
    with pytest.raises(PoolFullError, match="leased"):
        store.reserve(content(4), BLOCK_BYTES)
    assert held(store, range(1, 5)) == [1, 3]  # a failed reserve evicts nothing
    assert store.stats().num_evicted_blocks == 1
    assert (store.stats().num_leased_blocks, store.stats().num_leases) == (2, 1)

    assert store.release_request("req-a") == (2, 0)
    assert_idle(store, num_stored_blocks=2)
    put(store, content(4))  # released blocks rejoin the LRU in lease order: 1 goes first
    assert held(store, range(1, 5)) == [3, 4]


def test_block_larger_than_capacity_is_refused():
    store, _, _ = make_store(capacity_blocks=2)
    with pytest.raises(PoolFullError):
        store.reserve(content(1), 3 * BLOCK_BYTES)
    assert_idle(store, num_stored_blocks=0)


def test_scoped_block_is_freed_by_release_request():
    store, _, events = make_store()
    put(store, content(1))
    put(store, scoped("req-a", 0))
    store.lease([content(1), scoped("req-a", 0)], "req-a", ttl_s=5)
    stats = store.stats()
    assert (stats.num_stored_blocks, stats.num_scoped_blocks, stats.num_leased_blocks) == (1, 1, 2)
    assert stored_prefix(store, FP, [1]) == 1

    assert store.release_request("req-a") == (2, 1)
    assert store.block_state(scoped("req-a", 0)) is None
    assert store.release_request("req-a") == (0, 0)  # idempotent
    assert all(e.key.request_id is None for e in events)  # scoped blocks are never indexed
    assert_idle(store, num_stored_blocks=1)


def test_scoped_block_is_freed_when_its_lease_lapses():
    store, clock, _ = make_store(ttl_s=10)
    put(store, scoped("req-a", 0))  # deadline 10 (default ttl)
    put(store, content(1))
    store.lease([content(1)], "req-a", ttl_s=4)  # deadline stays 10: leases only extend it
    clock.now_s = 9.9
    assert store.expire() == []
    store.lease([content(1)], "req-a", ttl_s=5)  # deadline 14.9
    clock.now_s = 14.8
    assert store.expire() == []
    clock.now_s = 14.9
    assert store.expire() == ["req-a"]
    assert store.block_state(scoped("req-a", 0)) is None
    assert_idle(store, num_stored_blocks=1)


def test_a_scoped_block_written_under_a_lease_ttl_lives_by_it_not_by_the_default():
    # A worker configured with short leases (kv_lease_ttl_s) that dies after writing a request's
    # tail: the pool frees the tail at the worker's TTL, not its own 60 s default.
    store, clock, _ = make_store(ttl_s=60)
    reservation = store.reserve(scoped("req-a", 0), BLOCK_BYTES, ttl_s=10)
    store.write(reservation, 0, payload(0))
    store.commit(reservation)
    clock.now_s = 9.9
    assert store.expire() == []
    clock.now_s = 10.0
    assert store.expire() == ["req-a"]
    assert_idle(store, num_stored_blocks=0)
    with pytest.raises(ValueError, match="ttl_s must be >= 0"):
        store.reserve(scoped("req-b", 0), BLOCK_BYTES, ttl_s=-1)


def test_scoped_blocks_are_never_evicted():
    store, _, _ = make_store(capacity_blocks=2)
    put(store, scoped("req-a", 0))
    put(store, content(1))
    put(store, content(2))  # only the content block can make room
    assert store.block_state(scoped("req-a", 0)) is BlockState.STORED
    assert held(store, range(1, 3)) == [2]
    store.lease([content(2)], "req-b", ttl_s=5)
    with pytest.raises(PoolFullError):
        store.reserve(content(3), BLOCK_BYTES)
    store.release_request("req-a")
    store.release_request("req-b")
    assert_idle(store, num_stored_blocks=1)


def test_release_frees_a_scoped_block_still_being_written():
    store, _, _ = make_store()
    reservation = store.reserve(scoped("req-a", 0), BLOCK_BYTES)
    assert store.stats().num_writing_blocks == 1
    assert store.release_request("req-a") == (0, 1)
    with pytest.raises(StaleReservationError):
        store.write(reservation, 0, payload(0))
    assert store.abort(reservation) is False
    assert_idle(store, num_stored_blocks=0)


def test_freeing_a_scoped_block_drops_other_requests_leases_on_it():
    store, _, _ = make_store()
    put(store, scoped("req-a", 0))
    assert store.lease([scoped("req-a", 0), content(9)], "req-b", ttl_s=5) == 1  # 9 is not held
    assert (store.stats().num_leases, store.stats().num_leased_blocks) == (1, 1)
    store.release_request("req-a")
    assert store.release_request("req-b") == (0, 0)  # its only lease went with the block
    assert_idle(store, num_stored_blocks=0)


def test_lease_on_a_writing_block_survives_commit_and_dies_with_abort():
    store, _, _ = make_store(capacity_blocks=1)
    reservation = store.reserve(content(1), BLOCK_BYTES)
    store.lease([content(1)], "req-a", ttl_s=5)
    store.write(reservation, 0, payload(0))
    store.commit(reservation)
    with pytest.raises(PoolFullError):  # leased after commit: not evictable
        store.reserve(content(2), BLOCK_BYTES)
    store.release_request("req-a")

    aborted = store.reserve(content(3), BLOCK_BYTES)  # evicts 1
    store.lease([content(3)], "req-b", ttl_s=5)
    store.abort(aborted)
    assert store.release_request("req-b") == (0, 0)
    assert_idle(store, num_stored_blocks=0)


def test_stored_prefix_stops_at_the_first_gap():
    store, _, _ = make_store()
    for h in (1, 2, 4):
        put(store, content(h))
    writing = store.reserve(content(5), BLOCK_BYTES)
    assert stored_prefix(store, FP, [1, 2, 3, 4]) == 2
    assert stored_prefix(store, FP, [3, 4]) == 0
    assert stored_prefix(store, FP, [4, 5]) == 1  # a WRITING block is a gap
    assert stored_prefix(store, "other-spec", [1, 2]) == 0
    assert stored_prefix(store, FP, []) == 0
    store.abort(writing)
    assert_idle(store, num_stored_blocks=3)


def test_locate_leases_the_stored_prefix_only():
    store, _, _ = make_store(capacity_blocks=3)
    for h in (1, 2, 4):
        put(store, content(h))
    assert len(store.locate([content(h) for h in (1, 2, 3, 4)], "req-a", ttl_s=5)) == 2
    assert (store.stats().num_leased_blocks, store.stats().num_leases) == (2, 1)
    put(store, content(5))  # 4 is the only unleased block
    assert held(store, range(1, 6)) == [1, 2, 5]
    assert len(store.locate([content(h) for h in (7,)], "req-b", ttl_s=5)) == 0
    assert store.stats().num_leases == 1  # a lease on nothing holds nothing
    with pytest.raises(ValueError, match="ttl_s"):
        store.locate([content(1)], "req-c", ttl_s=0)
    assert store.release_request("req-a") == (2, 0)
    assert_idle(store, num_stored_blocks=3)


def test_renewing_a_lease_keeps_it_past_its_ttl_under_the_same_id():
    store, clock, _ = make_store(capacity_blocks=4, ttl_s=10)
    put(store, content(1), seed=1)
    assert len(store.locate([content(1)], "reader", ttl_s=5)) == 1
    lease_id = store.lease_id("reader")
    assert lease_id > 0
    clock.now_s = 4.0
    assert store.renew_lease("reader", lease_id, ttl_s=5)  # a read still running at 4 s of 5
    clock.now_s = 8.5  # past the first deadline (5 s), before the renewed one (9 s)
    assert store.expire() == []
    assert store.stats().num_leased_blocks == 1 and store.lease_id("reader") == lease_id
    clock.now_s = 9.0
    assert store.expire() == ["reader"]
    assert store.stats().num_leased_blocks == 0 and store.stats().num_leases == 0


def test_a_lapsed_lease_cannot_be_renewed_and_a_new_one_has_another_id():
    store, clock, _ = make_store(capacity_blocks=4, ttl_s=10)
    put(store, content(1), seed=1)
    store.locate([content(1)], "reader", ttl_s=5)
    old_id = store.lease_id("reader")
    clock.now_s = 5.0
    assert store.expire() == ["reader"]  # the read outlived its lease: the pool let go
    assert not store.renew_lease("reader", old_id, ttl_s=5)
    assert not store.renew_lease("reader", 0, ttl_s=5)  # "whichever it holds": it holds none
    assert store.lease_id("reader") == 0  # a failed renewal creates nothing
    store.locate([content(1)], "reader", ttl_s=5)  # the same request leases again
    new_id = store.lease_id("reader")
    assert new_id not in (0, old_id)
    assert not store.renew_lease("reader", old_id, ttl_s=5)  # the old read still cannot prove its lease
    assert store.renew_lease("reader", new_id, ttl_s=5) and store.renew_lease("reader", 0, ttl_s=5)
    store.release_request("reader")
    assert not store.renew_lease("reader", new_id, ttl_s=5)
    assert store.stats().num_leased_blocks == 0 and store.stats().num_leases == 0


def test_a_released_and_reused_slot_is_caught_by_the_lease_id():
    """The danger the id guards against: the lease lapses, the slot is freed and reused by
    another block, and a reader that located the old one would copy the new bytes."""
    store, clock, _ = make_store(capacity_blocks=1, ttl_s=10)
    put(store, scoped("writer"), seed=1)
    [old] = store.locate([scoped("writer")], "writer", ttl_s=5)
    lease_id = store.lease_id("writer")
    clock.now_s = 10.0
    assert store.expire() == ["writer"]  # the scoped block is freed with its request
    put(store, content(9), seed=9)  # the only slot, reused
    [new] = store.locate([content(9)], "other", ttl_s=5)
    assert new.offset_bytes == old.offset_bytes
    assert not store.renew_lease("writer", lease_id, ttl_s=5)
    store.release_request("other")
    assert store.stats().num_leases == 0


def test_renew_lease_refuses_bad_input_quoting_it():
    store, _, _ = make_store()
    with pytest.raises(ValueError, match="request_id must not be empty"):
        store.renew_lease("", 1, ttl_s=5)
    with pytest.raises(ValueError, match="ttl_s must be > 0, got 0"):
        store.renew_lease("r", 1, ttl_s=0)
