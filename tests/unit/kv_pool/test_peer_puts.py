"""PeerPuts: reservations a peer writes into the arena itself, committed, aborted or expired."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from kv_pool.block_store import BlockStore, PoolFullError
from kv_pool.peer_puts import PeerPuts
from tests.factories import stored_prefix

FP = "f" * 16


class FakeClock:
    now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def key(h: int) -> BlockKey:
    return BlockKey.content(FP, h)


def write(store: BlockStore, offset: int, data: bytes) -> None:
    store.arena.view[offset : offset + len(data)] = data  # what a shm / NIXL peer does


def test_commit_makes_peer_written_bytes_visible_and_leased():
    store, clock = BlockStore(100), FakeClock()
    puts = PeerPuts(store, ttl_s=5, clock=clock)
    [a, b] = puts.reserve([key(1), key(2)], 10, [11, 22], "req-a", 30)
    write(store, a.offset_bytes, b"a" * 10)
    write(store, b.offset_bytes, b"b" * 10)
    assert stored_prefix(store, FP, [1]) == 0  # WRITING: invisible
    assert len(puts.commit([a.reservation_id, b.reservation_id])) == 2
    assert store.get(key(1)) == b"a" * 10 and store.checksum(key(2)) == 22
    assert store.stats().num_leased_blocks == 2
    [dup] = puts.reserve([key(1)], 10, [], "req-b", 30)
    assert dup.duplicate and store.stats().num_leases == 2  # duplicates are leased at once
    store.release_request("req-a")
    store.release_request("req-b")
    assert (len(puts), store.stats().num_leases) == (0, 0)


def test_aborted_and_expired_reservations_are_never_visible():
    store, clock = BlockStore(100), FakeClock()
    puts = PeerPuts(store, ttl_s=5, clock=clock)
    [a] = puts.reserve([key(1)], 10, [], "", 0)
    puts.abort([a.reservation_id])
    [b] = puts.reserve([key(2)], 10, [], "", 0)
    write(store, b.offset_bytes, b"b" * 10)
    clock.now_s = 5.0
    assert puts.expire() == 1
    assert puts.commit([a.reservation_id, b.reservation_id]) == []  # too late
    assert stored_prefix(store, FP, [1]) == 0 and stored_prefix(store, FP, [2]) == 0
    assert (store.stats().used_bytes, store.stats().num_writing_blocks) == (0, 0)


def test_reserve_is_all_or_nothing():
    store = BlockStore(25)
    puts = PeerPuts(store, ttl_s=5)
    with pytest.raises(PoolFullError):
        puts.reserve([key(1), key(2), key(3)], 10, [], "", 0)
    assert (len(puts), store.stats().used_bytes) == (0, 0)
    with pytest.raises(ValueError, match="2 checksums for 1 keys"):
        puts.reserve([key(1)], 10, [1, 2], "", 0)
