"""One PutBlocks stream turned into two-phase puts on the block store (no gRPC here).

A stream carries blocks one after another; each block arrives as chunks in offset order::

    chunk(key, block_bytes, offset 0) ──► reserve
    chunk(offset = bytes received so far) ──► write      (key may be omitted after the first)
    ... last byte received ──► commit (or count a duplicate), then lease if asked

A stream that ends or fails inside a block must call ``abort``: the block never becomes visible.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.block_key import BlockKey
from kv_pool.block_store import DUPLICATE, BlockStore, Reservation
from kv_pool.block_types import Duplicate


@dataclass(frozen=True)
class Chunk:
    """Domain form of one ``PutBlocksRequest``."""

    key: BlockKey | None  # required on a block's first chunk; if present later, must match
    block_bytes: int  # size of the whole block; 0 on a later chunk means "as announced"
    offset_bytes: int
    data: bytes | memoryview
    lease_request_id: str = ""  # read from the first chunk: lease the block to it after commit
    lease_ttl_s: float = 0.0  # 0 means the pool's default
    checksum: int = 0  # of the whole block, read from the first chunk; 0 means none


@dataclass(eq=False)
class _Upload:
    key: BlockKey
    block_bytes: int
    reservation: Reservation | Duplicate
    lease_request_id: str
    lease_ttl_s: float
    received_bytes: int = 0


class PutSession:
    """Feeds the chunks of one stream into ``store``; counts committed and duplicate blocks."""

    def __init__(self, store: BlockStore, default_ttl_s: float):
        self._store = store
        self._default_ttl_s = default_ttl_s
        self._upload: _Upload | None = None
        self.num_committed_blocks = 0
        self.num_duplicate_blocks = 0

    def feed(self, chunk: Chunk) -> None:
        """Applies one chunk. Mutates: the store (reserve, write, commit, lease).

        Raises:
            ValueError: a malformed chunk (no key on a first chunk, offset or size mismatch, a
                chunk past the end of its block, an empty fingerprint).
            PoolFullError: no room for a new block.
            StaleReservationError: the block's request was released while it was being written.
        """
        upload = self._upload if self._upload is not None else self._begin(chunk)
        if chunk.key is not None and chunk.key != upload.key:
            raise ValueError(
                f"chunk of {chunk.key} inside {upload.key} at {upload.received_bytes} of {upload.block_bytes} bytes"
            )
        if chunk.block_bytes not in (0, upload.block_bytes):
            raise ValueError(f"{upload.key}: block_bytes {chunk.block_bytes}, announced {upload.block_bytes}")
        if chunk.offset_bytes != upload.received_bytes:
            raise ValueError(f"{upload.key}: chunk at offset {chunk.offset_bytes}, expected {upload.received_bytes}")
        end_bytes = upload.received_bytes + len(chunk.data)
        if end_bytes > upload.block_bytes:
            raise ValueError(f"{upload.key}: chunk ends at {end_bytes}, past block_bytes {upload.block_bytes}")
        if upload.reservation is not DUPLICATE:
            self._store.write(upload.reservation, chunk.offset_bytes, chunk.data)
        upload.received_bytes = end_bytes
        if end_bytes == upload.block_bytes:
            self._complete(upload)

    def finish(self) -> None:
        """Ends the stream. Raises ValueError (after aborting) if it stopped inside a block."""
        upload = self._upload
        if upload is not None:
            self.abort()
            raise ValueError(
                f"stream ended inside {upload.key} at {upload.received_bytes} of {upload.block_bytes} bytes"
            )

    def abort(self) -> None:
        """Rolls back the block in progress, if any; idempotent. Mutates: the store."""
        upload, self._upload = self._upload, None
        if upload is not None and upload.reservation is not DUPLICATE:
            self._store.abort(upload.reservation)

    def _begin(self, chunk: Chunk) -> _Upload:
        if chunk.key is None:
            raise ValueError(f"the first chunk of a block has no key (offset {chunk.offset_bytes})")
        if chunk.offset_bytes != 0:
            raise ValueError(f"{chunk.key}: first chunk at offset {chunk.offset_bytes}, expected 0")
        reservation = self._store.reserve(chunk.key, chunk.block_bytes, chunk.checksum, chunk.lease_ttl_s)
        ttl_s = chunk.lease_ttl_s or self._default_ttl_s
        self._upload = _Upload(chunk.key, chunk.block_bytes, reservation, chunk.lease_request_id, ttl_s)
        return self._upload

    def _complete(self, upload: _Upload) -> None:
        self._upload = None
        if upload.reservation is DUPLICATE:
            self.num_duplicate_blocks += 1
        else:
            self._store.commit(upload.reservation)
            self.num_committed_blocks += 1
        if upload.lease_request_id:
            self._store.lease([upload.key], upload.lease_request_id, upload.lease_ttl_s)
