"""Transfer backends against a real pool process: byte-identical round trips, leases held by
reads, two-phase writes, and a corrupted block caught by its checksum."""

from __future__ import annotations

import asyncio
import mmap
import multiprocessing
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.kv_transfer.checksum import block_checksum
from core.kv_transfer.select import connect
from core.kv_transfer.shm_backend import BATCH_BLOCKS
from core.pool_client import PoolClient
from engine.kv_connector import ArenaBlock, pack_blocks, unpack_blocks
from engine.kv_connector.load_failure import CHECKSUM, KVLoadError
from engine.kv_connector.pool_io import PoolIO
from tests.integration.test_kv_pool_server import SMOLLM_BLOCK_BYTES, block, client, fp, start_pool, stored_prefix  # noqa: F401
# client: a PoolClient on this module's `pool` that asserts the pool is idle after each test

BLOCK = SMOLLM_BLOCK_BYTES


@pytest.fixture(scope="module")
def pool(start_pool):
    return start_pool(16 * BLOCK, "--nixl", "on")


def isolated(mode: str, fn, *args) -> None:
    """Runs ``fn(*args)`` here, or for nixl in a fresh interpreter: NIXL's native libraries
    abort the process when grpc_tools' protoc (the proto drift test) was loaded first."""
    if mode != "nixl":
        fn(*args)
        return
    with multiprocessing.get_context("spawn").Pool(1) as child:
        child.apply(fn, args)


@pytest.mark.parametrize("mode", ["grpc", "shm", "nixl"])
def test_backend_round_trip_leases_and_dedups(pool, client, fp, mode):
    isolated(mode, _round_trip, pool.address, fp, mode)


def _round_trip(address: str, fp: str, mode: str) -> None:
    client = PoolClient(address, timeout_s=30)
    backend = connect(mode, client)
    assert backend.name == mode
    keys = [BlockKey.content(fp, h) for h in (1, 2, 3)] + [BlockKey.scoped(fp, "req-w", 3)]
    data = [block(h, BLOCK) for h in range(4)]
    checksums = [block_checksum(d) for d in data]
    assert backend.write(keys, data, checksums, "req-w", 30) == (4, 0)
    assert backend.write(keys[:2], data[:2], checksums[:2], "", 30) == (0, 2)  # duplicates: no copy
    assert client.stats()["num_leased_blocks"] == 4

    missing = BlockKey.content(fp, 99)
    blocks = backend.read([*keys[:3], missing, keys[3]], "req-r", 30)  # the stored prefix only
    assert [b.data for b in blocks] == data[:3]
    assert [b.checksum for b in blocks] == checksums[:3]
    assert client.stats()["num_leases"] == 2
    client.release_request("req-w")  # frees the scoped block
    client.release_request("req-r")
    assert stored_prefix(client, fp, [1, 2, 3]) == 3
    backend.close()
    client.close()


def test_aborted_reservation_is_never_visible(client, fp):
    key = BlockKey.content(fp, 7)
    [r] = client.reserve_blocks([key], BLOCK)
    assert stored_prefix(client, fp, [7]) == 0
    client.commit_blocks([r.reservation_id], abort=True)
    assert client.commit_blocks([r.reservation_id]) == 0 and stored_prefix(client, fp, [7]) == 0
    assert client.stats()["num_writing_blocks"] == 0


def test_shm_write_that_fails_midway_rolls_back(client, fp):
    backend = connect("shm", client)
    keys = [BlockKey.content(fp, h) for h in (1, 2)]
    with pytest.raises(ValueError, match="one size"):
        backend.write(keys, [b"x" * BLOCK, b"y" * 10], [], "", 30)

    real_copy_in = backend._copy_in

    def dies_after_the_first_block(reserved, views, block_bytes):
        real_copy_in(reserved[:1], views[:1], block_bytes)
        raise RuntimeError("worker died mid-copy")

    backend._copy_in = dies_after_the_first_block
    with pytest.raises(RuntimeError, match="mid-copy"):
        backend.write(keys, [block(1, BLOCK), block(2, BLOCK)], [], "", 30)
    assert stored_prefix(client, fp, [1]) == 0 and client.stats()["num_writing_blocks"] == 0
    backend.close()


@pytest.mark.parametrize("mode", ["grpc", "shm", "nixl"])
def test_corrupted_block_is_detected_dropped_and_the_read_fails(pool, client, fp, mode):
    isolated(mode, _corruption, pool.address, fp, mode)


def _corruption(address: str, fp: str, mode: str) -> None:
    client = PoolClient(address, timeout_s=30)
    spec = KVCacheSpec("m", "r", "float32", 1, 1, 4, 16)
    io = PoolIO(spec, lease_ttl_s=30, transfer=mode, verify_checksums=True)
    keys = [BlockKey.content(fp, h) for h in (1, 2, 3)]
    data = [block(h, BLOCK) for h in (1, 2, 3)]
    asyncio.run(io.store(address, "req-w", keys, data, skip=0))
    [_, loc, _] = client.locate_blocks(keys, "req-w", 30)
    client.release_request("req-w")
    with open(client.data_plane().arena_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as arena:
        arena[loc.offset_bytes + 100] ^= 0xFF  # a bit flip in the pool's DRAM

    corrupt_before = client.stats()["num_corrupt_blocks"]
    with pytest.raises(KVLoadError) as failed:  # no byte of the read is used: the caller recomputes
        fetch_bytes(io, address, keys, "req-r")
    assert failed.value.reason == CHECKSUM
    assert client.stats()["num_corrupt_blocks"] == corrupt_before + 1 and io.num_corrupt_blocks == 1
    assert stored_prefix(client, fp, [1, 2, 3]) == 1  # dropped by the pool; 3 is still stored
    asyncio.run(io.store(address, "req-r", keys, data, skip=1))  # the recompute writes it again
    assert fetch_bytes(io, address, keys, "req-r") == data
    client.release_request("req-r")
    io.close()
    client.close()


def fetch_bytes(io: PoolIO, address: str, keys: list[BlockKey], request_id: str) -> list[bytes]:
    """``io.fetch`` as bytes (shm gives ArenaBlock views, copied here and let go)."""
    return [bytes(b) for b in asyncio.run(io.fetch(address, keys, request_id))]


def test_unknown_or_unreachable_mode_is_refused(client):
    with pytest.raises(ValueError, match="must be one of"):
        connect("carrier-pigeon", client)
    with PoolClient("127.0.0.1:1", timeout_s=1) as dead, pytest.raises(grpc.RpcError):
        connect("auto", dead)
    assert os.path.exists("/dev/shm")


@pytest.mark.parametrize("mode", ["grpc", "shm"])
def test_concurrent_writers_of_one_hash_store_one_copy(pool, client, fp, mode):
    keys = [BlockKey.content(fp, h) for h in (1, 2)]
    data = [block(h, BLOCK) for h in (1, 2)]
    barrier = threading.Barrier(4)

    def writer(_: int) -> tuple[int, int]:
        with PoolClient(pool.address, timeout_s=30) as own:  # one channel per writer
            backend = connect(mode, own)
            barrier.wait()
            return backend.write(keys, data, [], "", 30)

    with ThreadPoolExecutor(4) as threads:
        results = list(threads.map(writer, range(4)))
    assert sum(c for c, _ in results) == 2 and sum(d for _, d in results) == 6  # one copy each
    assert client.get_blocks(keys) == data


def test_reader_that_dies_holding_a_lease_is_reclaimed(client, fp, wait_until):
    key = BlockKey.content(fp, 1)
    client.put_blocks([(key, block(1, BLOCK))])
    assert len(client.locate_blocks([key], "req-gone", ttl_s=0.3)) == 1  # and never releases
    assert client.stats()["num_leases"] == 1
    wait_until(lambda: client.stats()["num_leases"] == 0, timeout_s=10, message="the pool expired the lease")


def test_reservation_never_committed_is_rolled_back(start_pool, fp, wait_until):
    pool = start_pool(4 * BLOCK, "--put-reservation-ttl-s", "0.3")
    with PoolClient(pool.address, timeout_s=30) as client:
        [r] = client.reserve_blocks([BlockKey.content(fp, 1)], BLOCK)  # the writer dies here
        assert client.stats()["num_writing_blocks"] == 1
        wait_until(lambda: client.stats()["num_writing_blocks"] == 0, timeout_s=10, message="rolled back")
        assert client.commit_blocks([r.reservation_id]) == 0 and stored_prefix(client, fp, [1]) == 0
        assert client.stats()["used_bytes"] == 0


# A small paged KV cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], fp32.
CACHE_SHAPE = (2, 2, 8, 16, 2, 8)
CACHE_SPEC = KVCacheSpec("m", "r", "float32", 2, 2, 8, 16)


def test_shm_fetch_copies_from_the_mapped_arena_into_the_kv_cache(client, fp, pool, wait_until):
    source = torch.randn(CACHE_SHAPE)
    keys = [BlockKey.content(fp, h) for h in (11, 12, 13)]
    io = PoolIO(CACHE_SPEC, lease_ttl_s=30, transfer="shm", verify_checksums=True)
    asyncio.run(io.store(pool.address, "req-w", keys, pack_blocks(source, [5, 1, 6]), skip=0))
    client.release_request("req-w")

    payloads = asyncio.run(io.fetch(pool.address, keys, "req-r"))
    assert [type(p) for p in payloads] == [ArenaBlock] * 3
    arena_path = client.data_plane().arena_path
    [loc, *_] = client.locate_blocks(keys, "req-r", 30)
    with open(arena_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as arena:  # the pool's own bytes
        before = payloads[0][9]
        arena[loc.offset_bytes + 9] ^= 0xFF
        assert payloads[0][9] == before ^ 0xFF  # the view is the arena itself: no copy was made
        arena[loc.offset_bytes + 9] ^= 0xFF
    asyncio.run(io.release(pool.address, "req-r"))  # deferred: the views are not copied yet
    assert client.stats()["num_leased_blocks"] == 3

    cache = torch.zeros(CACHE_SHAPE)
    unpack_blocks(cache, [2, 7, 0], payloads)
    for dst, src in zip((2, 7, 0), (5, 1, 6)):
        assert torch.equal(cache[:, :, dst], source[:, :, src])  # byte-identical, fp32 compare
    assert torch.count_nonzero(cache[:, :, [1, 3, 4, 5, 6]]) == 0  # nothing else written
    wait_until(lambda: client.stats()["num_leases"] == 0, timeout_s=10, message="lease let go after the copy")
    assert os.path.exists(arena_path)
    io.close()


def test_shm_views_dropped_uncopied_release_the_lease(client, fp, pool, wait_until):
    keys = [BlockKey.content(fp, h) for h in (21, 22)]
    io = PoolIO(CACHE_SPEC, lease_ttl_s=30, transfer="shm")
    asyncio.run(io.store(pool.address, "req-w", keys, pack_blocks(torch.randn(CACHE_SHAPE), [0, 1]), skip=0))
    client.release_request("req-w")
    payloads = asyncio.run(io.fetch(pool.address, keys, "req-gone"))
    asyncio.run(io.release(pool.address, "req-gone"))
    assert client.stats()["num_leases"] == 1  # still held: the views could be copied any time
    del payloads  # the request went away before its KV was loaded
    wait_until(lambda: client.stats()["num_leases"] == 0, timeout_s=10, message="lease let go with the views")
    io.close()


def test_release_without_mapped_views_is_immediate(client, fp, pool):
    keys = [BlockKey.content(fp, h) for h in (31, 32)]
    data = pack_blocks(torch.randn(CACHE_SHAPE), [0, 1])
    io = PoolIO(CACHE_SPEC, lease_ttl_s=30, transfer="shm", map_arena=False)
    asyncio.run(io.store(pool.address, "req-w", keys, data, skip=0))
    client.release_request("req-w")
    assert asyncio.run(io.fetch(pool.address, keys, "req-r")) == data  # copies, as bytes
    asyncio.run(io.release(pool.address, "req-r"))
    assert client.stats()["num_leases"] == 0
    io.close()


def test_shm_long_read_is_located_in_batches_and_stops_at_a_gap(client, fp):

    backend = connect("shm", client)
    n = 2 * BATCH_BLOCKS + 44  # three ReserveBlocks / LocateBlocks batches
    keys = [BlockKey.content(fp, 1000 + h) for h in range(n)]
    data = [block(h, 1024) for h in range(n)]
    assert backend.write(keys, data, [], "", 30) == (n, 0)
    gap = BATCH_BLOCKS + 72  # missing in the second batch: the third is never asked
    asked = [*keys[:gap], BlockKey.content(fp, 99_999), *keys[gap:]]
    out = memoryview(bytearray(n * 1024))
    blocks = backend.read(asked, "req-r", 30, out=out)
    assert [bytes(b.data) for b in blocks] == data[:gap] and bytes(out[: gap * 1024]) == b"".join(data[:gap])
    assert client.stats()["num_leased_blocks"] == gap
    assert [b.data for b in backend.read(keys, "req-r", 30)] == data  # into new bytes
    client.release_request("req-r")
    backend.close()


def test_shm_pipelined_write_failing_in_a_later_batch_rolls_back_every_batch(client, fp):
    backend = connect("shm", client)
    size = 80 * 1024  # one batch (10.5 MB) fits the 11.8 MB pool, two do not
    keys = [BlockKey.content(fp, 5000 + h) for h in range(2 * BATCH_BLOCKS)]
    with pytest.raises(grpc.RpcError) as excinfo:
        backend.write(keys, [block(h, size) for h in range(len(keys))], [], "", 30)
    assert excinfo.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stats = client.stats()
    assert stats["num_writing_blocks"] == 0 and stored_prefix(client, fp, [5000 + h for h in range(len(keys))]) == 0
    backend.close()
