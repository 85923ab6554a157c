"""PutSession: chunk streams into two-phase puts, from plain bytes."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from kv_pool.block_store import BlockState, BlockStore, PoolFullError, StaleReservationError
from kv_pool.put_session import Chunk, PutSession

FP = "f" * 16


def key(block_hash: int) -> BlockKey:
    return BlockKey.content(FP, block_hash)


def test_blocks_commit_on_their_last_byte():
    store = BlockStore(1000)
    session = PutSession(store, default_ttl_s=10)
    session.feed(Chunk(key(1), 6, 0, b"abc"))
    assert store.block_state(key(1)) is BlockState.WRITING
    session.feed(Chunk(None, 0, 3, b"def"))  # later chunks may omit key and size
    session.feed(Chunk(key(2), 2, 0, b"gh"))
    session.finish()
    assert (session.num_committed_blocks, session.num_duplicate_blocks) == (2, 0)
    assert [bytes(store.get(key(h))) for h in (1, 2)] == [b"abcdef", b"gh"]


def test_duplicate_is_counted_and_still_leased():
    store = BlockStore(1000)
    PutSession(store, 10).feed(Chunk(key(1), 2, 0, b"ab"))
    session = PutSession(store, default_ttl_s=10)
    session.feed(Chunk(key(1), 2, 0, b"zz", lease_request_id="req-a"))
    assert (session.num_committed_blocks, session.num_duplicate_blocks) == (0, 1)
    assert bytes(store.get(key(1))) == b"ab"
    assert (store.stats().num_leased_blocks, store.stats().num_leases) == (1, 1)
    store.release_request("req-a")


@pytest.mark.parametrize(
    "chunks, message",
    [
        ([Chunk(None, 4, 0, b"ab")], "has no key"),
        ([Chunk(key(1), 4, 2, b"ab")], "first chunk at offset 2"),
        ([Chunk(key(1), 4, 0, b"ab"), Chunk(key(1), 4, 1, b"b")], "offset 1, expected 2"),
        ([Chunk(key(1), 4, 0, b"ab"), Chunk(key(1), 5, 2, b"cd")], "block_bytes 5, announced 4"),
        ([Chunk(key(1), 4, 0, b"ab"), Chunk(key(2), 4, 2, b"cd")], "inside"),
        ([Chunk(key(1), 4, 0, b"abcde")], "past block_bytes"),
        ([Chunk(BlockKey.content("", 1), 4, 0, b"ab")], "spec_fingerprint"),
    ],
)
def test_malformed_streams_raise_and_leave_nothing(chunks, message):
    store = BlockStore(1000)
    session = PutSession(store, default_ttl_s=10)
    with pytest.raises(ValueError, match=message):
        for chunk in chunks:
            session.feed(chunk)
    session.abort()
    assert store.stats().used_bytes == 0 and store.stats().num_writing_blocks == 0


def test_stream_ending_mid_block_aborts_it():
    store = BlockStore(1000)
    session = PutSession(store, default_ttl_s=10)
    session.feed(Chunk(key(1), 4, 0, b"ab"))
    with pytest.raises(ValueError, match="stream ended inside"):
        session.finish()
    assert store.block_state(key(1)) is None and store.stats().used_bytes == 0


def test_pool_full_propagates():
    store = BlockStore(3)
    with pytest.raises(PoolFullError):
        PutSession(store, 10).feed(Chunk(key(1), 4, 0, b"ab"))


def test_scoped_block_released_mid_upload_goes_stale():
    store = BlockStore(1000)
    session = PutSession(store, default_ttl_s=10)
    scoped = BlockKey.scoped(FP, "req-a", 0)
    session.feed(Chunk(scoped, 4, 0, b"ab"))
    store.release_request("req-a")
    with pytest.raises(StaleReservationError):
        session.feed(Chunk(None, 0, 2, b"cd"))
    session.abort()
    assert store.stats().used_bytes == 0
