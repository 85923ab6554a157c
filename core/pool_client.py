"""Client of the KV pool (``tandem.v1.KVPool``), blocking: workers call it from worker threads
(engine.kv_connector.pool_io), never from their event loop.

It speaks in domain types (:class:`BlockKey`, ``bytes``); protobuf stays inside this module.
Every method raises ``grpc.RpcError`` when the call fails; ``err.code()`` tells why:

- ``INVALID_ARGUMENT``: a malformed key, an empty fingerprint or request_id;
- ``NOT_FOUND``: ``get_blocks`` named a block the pool does not hold (never stored or evicted;
  hold a lease to prevent eviction);
- ``RESOURCE_EXHAUSTED``: ``put_blocks`` found the pool full of leased/scoped/in-flight blocks;
- ``UNAVAILABLE`` / ``DEADLINE_EXCEEDED``: the pool is down or slow.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from core.block_key import BlockKey
from core.grpc_service import insecure_channel
from core.proto_convert import block_key_to_proto
from tandem.v1 import kv_pool_pb2, kv_pool_pb2_grpc

# Largest data field of one PutBlocks / GetBlocks message; bigger blocks travel as several chunks.
MAX_CHUNK_BYTES = 4 * 1024 * 1024

BlockBytes = bytes | bytearray | memoryview


@dataclass(frozen=True)
class BlockLocation:
    """Where a leased block is in the pool's DRAM arena (``LocateBlocks``)."""

    offset_bytes: int
    block_bytes: int
    checksum: int  # the writer's, 0: none
    lease_id: int = 0  # the request's lease it is held under (LocateBlocksResponse.lease_id)


@dataclass(frozen=True)
class ReservedBlock:
    """One answer of ``ReserveBlocks``: write ``block_bytes`` at ``offset_bytes`` unless duplicate."""

    duplicate: bool
    offset_bytes: int
    reservation_id: int


@dataclass(frozen=True)
class DataPlane:
    """``GetDataPlane``: how a peer may reach the pool's arena itself."""

    host_id: str
    arena_path: str
    arena_bytes: int
    nixl_agent_name: str
    nixl_agent_metadata: bytes
    nixl_arena_address: int


def _ttl_ms(ttl_s: float) -> int:
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
    return max(1, round(ttl_s * 1000))


def _chunk_blocks(items: Iterable[tuple[BlockKey, BlockBytes]]) -> list[tuple[BlockKey, memoryview]]:
    """Byte views of every block, checked before any byte is sent.

    Raises:
        ValueError: an empty block (the pool stores none) or a non-contiguous buffer.
    """
    blocks = [(key, memoryview(data).cast("B")) for key, data in items]
    for key, view in blocks:
        if len(view) == 0:
            raise ValueError(f"block {key} is empty")
    return blocks


def _put_requests(
    blocks: list[tuple[BlockKey, memoryview]], lease_request_id: str, lease_ttl_s: float,
    checksums: Sequence[int] = (),
) -> Iterator[kv_pool_pb2.PutBlocksRequest]:
    """Chunks every block at MAX_CHUNK_BYTES; the key and block size ride on every chunk."""
    ttl_ms = _ttl_ms(lease_ttl_s) if lease_request_id else 0
    for i, (key, view) in enumerate(blocks):
        key_msg = block_key_to_proto(key)
        checksum = checksums[i] if checksums else 0
        for offset in range(0, len(view), MAX_CHUNK_BYTES):
            yield kv_pool_pb2.PutBlocksRequest(
                key=key_msg,
                block_bytes=len(view),
                offset_bytes=offset,
                data=bytes(view[offset : offset + MAX_CHUNK_BYTES]),
                lease_request_id=lease_request_id,
                lease_ttl_ms=ttl_ms,
                checksum=checksum,
            )


class IncompleteReadError(ValueError):
    """The pool's GetBlocks stream ended before every requested block arrived whole (a transfer
    cut off): the pool's fault, not the caller's input."""


class _BlockAssembler:
    """Reassembles GetBlocks chunks into one ``bytes`` per requested key, in request order."""

    def __init__(self, keys: Sequence[BlockKey]):
        self._keys = keys
        self._parts: list[list[bytes]] = [[] for _ in keys]
        self._sizes = [0] * len(keys)
        self._received = [0] * len(keys)
        self.checksums = [0] * len(keys)  # the writer's, per key (0: none)

    def add(self, msg: kv_pool_pb2.GetBlocksResponse) -> None:
        i = msg.key_index
        if i >= len(self._keys) or msg.offset_bytes != self._received[i]:
            raise IncompleteReadError(f"pool sent chunk key_index={i} offset={msg.offset_bytes} out of order")
        self._sizes[i] = msg.block_bytes
        self.checksums[i] = msg.checksum
        self._parts[i].append(msg.data)
        self._received[i] += len(msg.data)

    def blocks(self) -> list[bytes]:
        """Raises IncompleteReadError if a block arrived incomplete (or not at all)."""
        for key, size, received in zip(self._keys, self._sizes, self._received):
            if received != size or size == 0:
                raise IncompleteReadError(f"block {key}: pool sent {received} of {size} bytes")
        return [parts[0] if len(parts) == 1 else b"".join(parts) for parts in self._parts]


def _stats_dict(msg: kv_pool_pb2.GetPoolStatsResponse) -> dict[str, int]:
    return {field.name: getattr(msg, field.name) for field in msg.DESCRIPTOR.fields}


class PoolClient:
    """Blocking client of one pool node; thread-safe (one gRPC channel, shareable).

    ``timeout_s`` bounds every call (None: no deadline).
    """

    def __init__(self, address: str, timeout_s: float | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = insecure_channel(address)
        self._stub = kv_pool_pb2_grpc.KVPoolStub(self._channel)

    def put_blocks(
        self, items: Iterable[tuple[BlockKey, BlockBytes]], lease_request_id: str = "", lease_ttl_s: float = 60.0,
        checksums: Sequence[int] = (),
    ) -> tuple[int, int]:
        """Stores blocks (two-phase, all-or-nothing per block); returns (committed, duplicates).

        With ``lease_request_id``, every block (duplicates too) is leased to it for ``lease_ttl_s``.
        ``checksums`` (one per block, or none) are kept by the pool for readers to verify.
        Blocks committed before a failure stay stored; the block in flight is rolled back.

        Raises:
            ValueError: an empty block or ``lease_ttl_s`` <= 0 (before anything is sent).
            grpc.RpcError: the put failed (see the module docstring).
        """
        if lease_request_id:
            _ttl_ms(lease_ttl_s)  # a bad ttl raises here, not inside gRPC's sending thread
        requests = _put_requests(_chunk_blocks(items), lease_request_id, lease_ttl_s, checksums)
        response = self._stub.PutBlocks(requests, timeout=self.timeout_s)
        return response.num_committed_blocks, response.num_duplicate_blocks

    def get_blocks(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """The bytes of each key, in the order of ``keys``.

        Raises:
            grpc.RpcError: NOT_FOUND names the first key the pool does not hold.
            IncompleteReadError (a ValueError): the pool sent a block incomplete or out of order.
        """
        return [data for data, _ in self.get_blocks_with_checksums(keys)]

    def get_blocks_with_checksums(self, keys: Sequence[BlockKey]) -> list[tuple[bytes, int]]:
        """As ``get_blocks``, each with the writer's checksum (0: none)."""
        assembler = _BlockAssembler(keys)
        msg = kv_pool_pb2.GetBlocksRequest(keys=[block_key_to_proto(k) for k in keys])
        for chunk in self._stub.GetBlocks(msg, timeout=self.timeout_s):
            assembler.add(chunk)
        return list(zip(assembler.blocks(), assembler.checksums))

    def locate_blocks(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float) -> list[BlockLocation]:
        """Leases the longest stored prefix of ``keys`` to ``request_id``; where each block is."""
        msg = kv_pool_pb2.LocateBlocksRequest(
            keys=[block_key_to_proto(k) for k in keys], request_id=request_id, ttl_ms=_ttl_ms(ttl_s)
        )
        response = self._stub.LocateBlocks(msg, timeout=self.timeout_s)
        lease_id = response.lease_id
        return [BlockLocation(m.offset_bytes, m.block_bytes, m.checksum, lease_id) for m in response.locations]

    def renew_lease(self, request_id: str, lease_id: int, ttl_s: float) -> bool:
        """Extends lease ``lease_id`` of ``request_id`` (from ``locate_blocks``) by ``ttl_s``;
        False when that lease is gone (released, lapsed, the pool restarted)."""
        msg = kv_pool_pb2.RenewLeaseRequest(request_id=request_id, lease_id=lease_id, ttl_ms=_ttl_ms(ttl_s))
        return self._stub.RenewLease(msg, timeout=self.timeout_s).held

    def reserve_blocks(
        self, keys: Sequence[BlockKey], block_bytes: int, checksums: Sequence[int] = (),
        lease_request_id: str = "", lease_ttl_s: float = 60.0,
    ) -> list[ReservedBlock]:
        """Reserves arena slots for blocks the caller writes itself (all or nothing).

        Raises:
            grpc.RpcError: RESOURCE_EXHAUSTED when the pool has no room for all of them.
        """
        msg = kv_pool_pb2.ReserveBlocksRequest(
            keys=[block_key_to_proto(k) for k in keys], block_bytes=block_bytes, checksums=checksums,
            lease_request_id=lease_request_id, lease_ttl_ms=_ttl_ms(lease_ttl_s) if lease_request_id else 0,
        )
        response = self._stub.ReserveBlocks(msg, timeout=self.timeout_s)
        return [ReservedBlock(b.duplicate, b.offset_bytes, b.reservation_id) for b in response.blocks]

    def commit_blocks(self, reservation_ids: Sequence[int], abort: bool = False) -> int:
        """Commits (or rolls back) reserved blocks; returns how many became visible."""
        msg = kv_pool_pb2.CommitBlocksRequest(reservation_ids=reservation_ids, abort=abort)
        return self._stub.CommitBlocks(msg, timeout=self.timeout_s).num_committed_blocks

    def report_corrupt(self, keys: Sequence[BlockKey]) -> int:
        """Tells the pool these blocks failed verification (it drops them); returns how many."""
        msg = kv_pool_pb2.ReportCorruptBlocksRequest(keys=[block_key_to_proto(k) for k in keys])
        return self._stub.ReportCorruptBlocks(msg, timeout=self.timeout_s).num_dropped_blocks

    def data_plane(self) -> DataPlane:
        m = self._stub.GetDataPlane(kv_pool_pb2.GetDataPlaneRequest(), timeout=self.timeout_s)
        return DataPlane(
            m.host_id, m.arena_path, m.arena_bytes, m.nixl_agent_name, m.nixl_agent_metadata, m.nixl_arena_address
        )

    def release_request(self, request_id: str) -> None:
        """Drops the request's leases and frees its scoped blocks; idempotent."""
        self._stub.ReleaseRequest(kv_pool_pb2.ReleaseRequestRequest(request_id=request_id), timeout=self.timeout_s)

    def stats(self) -> dict[str, int]:
        """``GetPoolStatsResponse`` as a dict (``num_stored_blocks``, ``used_bytes``, ...)."""
        return _stats_dict(self._stub.GetStats(kv_pool_pb2.GetPoolStatsRequest(), timeout=self.timeout_s))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
