"""Same-host transfer through the pool's DRAM arena, a shared-memory file this process maps.

Reads: ``LocateBlocks`` leases the blocks and returns their arena offsets; one ``memcpy`` per
block out of the mapping. Writes: ``ReserveBlocks`` returns offsets of WRITING slots, one
``memcpy`` per block into the mapping, then ``CommitBlocks`` (or a rollback on any error).

A pool that restarted made a new arena file at the same path: the mapping is checked against
the file's inode after each RPC and remapped when it changed, so offsets from the new pool are
never applied to the old pool's memory.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Sequence

from core.block_key import BlockKey
from core.kv_transfer.backend import ReadBlock, TransferBackend, place
from core.kv_transfer.host import host_id
from core.pool_client import BlockBytes, PoolClient

log = logging.getLogger(__name__)


class ShmBackend(TransferBackend):
    name = "shm"

    def __init__(self, client: PoolClient):
        super().__init__(client)
        self._path = ""
        self._inode = (0, 0)
        self._buffer: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._lock = threading.Lock()  # PoolIO calls from several threads

    @classmethod
    def available(cls, client: PoolClient) -> bool:
        """Whether the pool's arena is a file on this host that this process can map."""
        plane = client.data_plane()
        if not plane.arena_path or plane.host_id != host_id():
            return False
        return os.access(plane.arena_path, os.R_OK | os.W_OK)

    def read(
        self, keys: Sequence[BlockKey], request_id: str, ttl_s: float, out: memoryview | None = None
    ) -> list[ReadBlock]:
        locations = self.client.locate_blocks(keys, request_id, ttl_s)  # leased: slots stay put
        if not locations:
            return []
        view = self._mapping()
        blocks, offset = [], 0
        for loc in locations:
            data = place(out, offset, view[loc.offset_bytes : loc.offset_bytes + loc.block_bytes])
            blocks.append(ReadBlock(data, loc.checksum))
            offset += loc.block_bytes
        return blocks

    def write(
        self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
        request_id: str, ttl_s: float,
    ) -> tuple[int, int]:
        if not keys:
            return 0, 0
        sizes = {len(memoryview(p).cast("B")) for p in payloads}
        if len(sizes) != 1:
            raise ValueError(f"shm writes blocks of one size, got sizes {sorted(sizes)}")
        block_bytes = sizes.pop()
        reserved = self.client.reserve_blocks(keys, block_bytes, checksums, request_id, ttl_s)
        ids = [r.reservation_id for r in reserved if not r.duplicate]
        try:
            view = self._mapping()
            for r, payload in zip(reserved, payloads):
                if not r.duplicate:
                    view[r.offset_bytes : r.offset_bytes + block_bytes] = memoryview(payload).cast("B")
            num_committed = self.client.commit_blocks(ids)
        except BaseException:
            try:
                self.client.commit_blocks(ids, abort=True)
            except Exception:  # the pool is gone or slow: its reservation expiry rolls back
                log.warning("could not roll back %d reserved blocks", len(ids), exc_info=True)
            raise
        return num_committed, len(reserved) - len(ids)

    def close(self) -> None:
        if self._view is not None:
            self._view.release()
            self._view = None
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None

    def _mapping(self) -> memoryview:
        """The arena mapping, (re)mapped when the file at the arena path is a new one.

        Raises:
            OSError: the arena file cannot be opened or mapped.
        """
        with self._lock:
            if self._path and self._view is not None:
                st = os.stat(self._path)
                if (st.st_dev, st.st_ino) == self._inode:
                    return self._view
            plane = self.client.data_plane()
            fd = os.open(plane.arena_path, os.O_RDWR)
            try:
                st = os.fstat(fd)
                buffer = mmap.mmap(fd, plane.arena_bytes)
            finally:
                os.close(fd)
            # An old mapping is dropped, not closed: another thread may still be copying from it.
            self._buffer, self._view = buffer, memoryview(buffer)
            self._path, self._inode = plane.arena_path, (st.st_dev, st.st_ino)
            return self._view
