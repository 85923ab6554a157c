"""The one interface every KV transfer backend implements (gRPC, shared memory, NIXL).

Both directions keep the pool's ownership rules (docs/design.md §5): a read leases the blocks to the
request before any byte moves (the pool cannot evict or reuse their slots mid-copy), a write is
a two-phase put (nothing is visible until the pool commits it). Backends move bytes and report
the writer's checksums; verifying them is the caller's business (``engine.kv_connector.pool_io``).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from core.block_key import BlockKey
from core.pool_client import BlockBytes, PoolClient


@dataclass(frozen=True)
class ReadBlock:
    data: bytes | memoryview  # [block_bytes], uint8; the caller's own copy (or a view of ``out``)
    checksum: int  # the writer's, 0: none
    lease_id: int = 0  # the pool lease it was read under (core.pool_client.BlockLocation.lease_id)


def place(out: memoryview | None, offset: int, data: bytes | memoryview) -> bytes | memoryview:
    """``data`` as the caller's copy: copied into ``out`` at ``offset`` (returning that view),
    or into a new ``bytes``. Raises ValueError when ``out`` is too small."""
    if out is None:
        return bytes(data)
    end = offset + len(data)
    if end > len(out):
        raise ValueError(f"read buffer of {len(out)} bytes is too small for {end}")
    out[offset:end] = data
    return out[offset:end]


class TransferBackend(abc.ABC):
    """Moves blocks between this process and one pool node (``client``'s)."""

    name: ClassVar[str]

    def __init__(self, client: PoolClient):
        self.client = client

    @abc.abstractmethod
    def read(
        self, keys: Sequence[BlockKey], request_id: str, ttl_s: float, out: memoryview | None = None
    ) -> list[ReadBlock]:
        """Leases the longest stored prefix of ``keys`` to ``request_id`` (until it is released or
        ``ttl_s`` lapses) and copies it out; returns one block per leased key, in order.

        ``out``: a writable byte buffer the blocks are copied into back to back (each
        ``ReadBlock.data`` is then a view of it); without it each block is a new ``bytes``.
        Copying into memory that is already faulted in is what reaches memcpy speed.

        Raises:
            grpc.RpcError: the pool failed. OSError: the data plane failed.
        """

    def read_views(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float) -> list[ReadBlock] | None:
        """As ``read`` without copying: each ``ReadBlock.data`` is a read-write view of the pool's
        own memory, valid while ``request_id``'s lease lives (release it only once the bytes are
        copied). None when this backend cannot map the pool's memory (only shared memory can).

        Raises:
            grpc.RpcError: the pool failed. OSError: the mapping failed.
        """
        return None

    @abc.abstractmethod
    def write(
        self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
        request_id: str, ttl_s: float,
    ) -> tuple[int, int]:
        """Stores blocks two-phase, each leased to ``request_id`` afterwards (when given);
        returns (committed, duplicates). ``checksums``: one per block, or empty.

        Raises:
            grpc.RpcError: RESOURCE_EXHAUSTED when the pool is full; others when it failed.
        """

    def close(self) -> None:
        """Releases what the backend holds besides the client (mappings, agents)."""
