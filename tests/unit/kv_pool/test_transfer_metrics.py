"""tandem:pool_transfer_bytes_total counts the blocks a shm / NIXL peer moves itself (the bytes of
the blocks it reserved, wrote and committed: put), as a gRPC PutBlocks stream counts what it
carries, and every read once, when its blocks are leased (LocateBlocks: get), whatever the
transport that copies them next."""

from __future__ import annotations

from core.block_key import BlockKey
from core.proto_convert import block_key_to_proto
from kv_pool.block_store import BlockStore
from kv_pool.metrics import PoolMetrics
from kv_pool.peer_puts import PeerPuts
from kv_pool.servicer import KVPoolServicer
from tandem.v1 import kv_pool_pb2

FP = "f" * 16
BLOCK_BYTES = 10


def transferred(metrics: PoolMetrics, direction: str) -> float:
    return metrics.registry.get_sample_value("tandem:pool_transfer_bytes_total", {"direction": direction})


async def test_direct_puts_and_reads_are_counted_once_committed_or_located():
    store = BlockStore(100)
    metrics = PoolMetrics(store.stats)
    servicer = KVPoolServicer(store, metrics, default_ttl_s=30, peer_puts=PeerPuts(store, 5.0))
    keys = [block_key_to_proto(BlockKey.content(FP, h)) for h in (1, 2, 3)]

    reserved = await servicer.ReserveBlocks(kv_pool_pb2.ReserveBlocksRequest(
        keys=keys, block_bytes=BLOCK_BYTES, lease_request_id="r1", lease_ttl_ms=30_000), None)
    assert transferred(metrics, "put") == 0  # reserved, not yet written
    for block in reserved.blocks:
        store.arena.view[block.offset_bytes : block.offset_bytes + BLOCK_BYTES] = b"x" * BLOCK_BYTES
    ids = [b.reservation_id for b in reserved.blocks]
    await servicer.CommitBlocks(kv_pool_pb2.CommitBlocksRequest(reservation_ids=ids[:1], abort=True), None)
    committed = await servicer.CommitBlocks(kv_pool_pb2.CommitBlocksRequest(reservation_ids=ids[1:]), None)
    assert committed.num_committed_blocks == 2
    assert transferred(metrics, "put") == 2 * BLOCK_BYTES  # the aborted block moved nothing that counts

    located = await servicer.LocateBlocks(kv_pool_pb2.LocateBlocksRequest(keys=keys[1:], request_id="r2"), None)
    assert len(located.locations) == 2
    assert transferred(metrics, "get") == 2 * BLOCK_BYTES



async def test_a_grpc_read_counts_its_blocks_once():
    """gRPC reads lease first (core.kv_transfer.grpc_backend) and then stream the same blocks."""
    store = BlockStore(100)
    metrics = PoolMetrics(store.stats)
    puts = PeerPuts(store, 5.0)
    servicer = KVPoolServicer(store, metrics, default_ttl_s=30, peer_puts=puts)
    keys = [block_key_to_proto(BlockKey.content(FP, 7))]
    [block] = (await servicer.ReserveBlocks(kv_pool_pb2.ReserveBlocksRequest(keys=keys, block_bytes=BLOCK_BYTES),
                                            None)).blocks
    store.arena.view[block.offset_bytes : block.offset_bytes + BLOCK_BYTES] = b"y" * BLOCK_BYTES
    await servicer.CommitBlocks(kv_pool_pb2.CommitBlocksRequest(reservation_ids=[block.reservation_id]), None)

    await servicer.LocateBlocks(kv_pool_pb2.LocateBlocksRequest(keys=keys, request_id="r"), None)
    chunks = [c async for c in servicer.GetBlocks(kv_pool_pb2.GetBlocksRequest(keys=keys), None)]
    assert b"".join(c.data for c in chunks) == b"y" * BLOCK_BYTES
    assert transferred(metrics, "get") == BLOCK_BYTES
