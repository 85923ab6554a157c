"""PoolIO over a ring of pool nodes, with fake backends: placement, verification, dead nodes."""

from __future__ import annotations

import asyncio

import grpc

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.kv_transfer.checksum import block_checksum
from core.pool_ring import HashRing
import pytest

from engine.kv_connector.load_failure import CHECKSUM, UNREACHABLE, KVLoadError
from engine.kv_connector.pool_io import PoolIO

SPEC = KVCacheSpec("m", "r", "float32", 1, 1, 4, 16)


class Unavailable(grpc.RpcError):
    def details(self) -> str:
        return "connection refused"


class FakeNode(TransferBackend):
    """An in-memory pool node; ``dead`` makes every call fail like a killed process."""

    name = "fake"

    def __init__(self):
        self.blocks: dict[BlockKey, tuple[bytes, int]] = {}
        self.dead = False
        self.reported: list[BlockKey] = []

    def read(self, keys, request_id, ttl_s, out=None):
        if self.dead:
            raise Unavailable()
        found = []
        for key in keys:
            if key not in self.blocks:
                break
            found.append(ReadBlock(*self.blocks[key]))
        return found

    def write(self, keys, payloads, checksums, request_id, ttl_s):
        if self.dead:
            raise Unavailable()
        for key, payload, checksum in zip(keys, payloads, checksums):
            self.blocks[key] = (bytes(payload), checksum)
        return len(keys), 0


def make_io(num_nodes: int = 2) -> tuple[PoolIO, HashRing, dict[str, FakeNode]]:
    ring = HashRing({f"pool-{i}": f"node{i}:1" for i in range(num_nodes)})
    io = PoolIO(SPEC, transfer="grpc", verify_checksums=True)
    nodes = {address: FakeNode() for address in ring.addresses}
    io._backends.update(nodes)
    return io, ring, nodes


def keys_and_data(n: int) -> tuple[list[BlockKey], list[bytes]]:
    return [BlockKey.content(SPEC.fingerprint, 1000 + h) for h in range(n)], [bytes([h]) * 64 for h in range(n)]


def test_blocks_spread_over_nodes_and_read_back_in_order():
    io, ring, nodes = make_io()
    keys, data = keys_and_data(40)
    asyncio.run(io.store(ring, "req", keys, data, skip=0))
    assert all(len(node.blocks) > 5 for node in nodes.values())  # both nodes got a share
    assert all(key in nodes[ring.address_for(key)].blocks for key in keys)
    assert asyncio.run(io.fetch(ring, keys, "req")) == data


def test_a_dead_node_fails_the_read_as_unreachable():
    io, ring, nodes = make_io()
    keys, data = keys_and_data(40)
    asyncio.run(io.store(ring, "req", keys, data, skip=0))
    dead = ring.address_for(keys[7])
    nodes[dead].dead = True
    with pytest.raises(KVLoadError) as failed:
        asyncio.run(io.fetch(ring, keys, "req"))
    assert failed.value.reason == UNREACHABLE and dead in str(failed.value)
    asyncio.run(io.store(ring, "req", keys, data, skip=0))  # the dead node's share is skipped, not fatal
    nodes[dead].dead = False  # a read that never reaches it still succeeds
    first_dead = next(i for i, k in enumerate(keys) if ring.address_for(k) == dead)
    assert asyncio.run(io.fetch(ring, keys[:first_dead], "req")) == data[:first_dead]


def test_a_corrupt_block_fails_the_read_and_is_reported():
    io, ring, nodes = make_io(num_nodes=1)
    keys, data = keys_and_data(4)
    asyncio.run(io.store(ring, "req", keys, data, skip=0))
    [node] = nodes.values()
    node.blocks[keys[2]] = (b"x" * 64, block_checksum(data[2]))  # bytes changed after the write
    reported = []
    io.client(ring.addresses[0]).report_corrupt = reported.extend  # no real pool here
    with pytest.raises(KVLoadError) as failed:
        asyncio.run(io.fetch(ring, keys, "req"))
    assert failed.value.reason == CHECKSUM
    assert reported == [keys[2]] and io.num_corrupt_blocks == 1


class ShiftingLeaseNode(FakeNode):
    """A node whose second batch of a read comes under another lease (the first lapsed between)."""

    def read(self, keys, request_id, ttl_s, out=None):
        return [ReadBlock(*self.blocks[k], lease_id=1 + (i >= 2)) for i, k in enumerate(keys)]


class CuttingNode(FakeNode):
    def read(self, keys, request_id, ttl_s, out=None):
        from core.pool_client import IncompleteReadError

        raise IncompleteReadError("block k: pool sent 0 of 64 bytes")


@pytest.mark.parametrize(("node_type", "reason"), [(ShiftingLeaseNode, "lease_lost"), (CuttingNode, "truncated")])
def test_a_read_under_two_leases_or_cut_short_fails_with_its_reason(node_type, reason):
    io, ring, nodes = make_io(num_nodes=1)
    keys, data = keys_and_data(4)
    [address] = ring.addresses
    node = io._backends[address] = node_type()
    node.blocks = {k: (d, block_checksum(d)) for k, d in zip(keys, data)}
    with pytest.raises(KVLoadError) as failed:
        asyncio.run(io.fetch(ring, keys, "req"))
    assert failed.value.reason == reason
    io.close()
