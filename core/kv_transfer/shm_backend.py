"""Same-host transfer through the pool's DRAM arena, a shared-memory file this process maps.

Reads: ``LocateBlocks`` leases the blocks and returns their arena offsets; blocks in adjacent
slots (a batch written together usually is) are copied out with one copy per run: a copy of a
whole run is ~2x faster than block-sized ones here (past libc's non-temporal threshold the copy
streams past the cache). ``read_views`` skips the copy: the caller gets views of the mapping and
copies them straight into its KV cache (``engine.kv_connector``). Writes: ``ReserveBlocks``
returns offsets of WRITING slots, one copy per block into the mapping, then one ``CommitBlocks``
(or a rollback of every reservation on any error).

Long transfers go in batches of ``BATCH_BLOCKS``: the next batch's LocateBlocks / ReserveBlocks is
in flight while this batch is copied (numpy copies without the GIL), so the pool's per-block
bookkeeping hides behind the copy (~15 ms of RPCs for a 16k-token prompt's 1024 blocks).

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
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from core.block_key import BlockKey
from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.kv_transfer.host import host_id
from core.pool_client import BlockBytes, BlockLocation, PoolClient, ReservedBlock

log = logging.getLogger(__name__)

BATCH_BLOCKS = 128  # blocks per LocateBlocks / ReserveBlocks of a pipelined transfer (~94 MB of SmolLM2 KV)


class ShmBackend(TransferBackend):
    name = "shm"

    def __init__(self, client: PoolClient):
        super().__init__(client)
        self._path = ""
        self._inode = (0, 0)
        self._buffer: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._lock = threading.Lock()  # PoolIO calls from several threads
        self._rpc: ThreadPoolExecutor | None = None  # the next batch's LocateBlocks / ReserveBlocks

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
        batches = [keys[i : i + BATCH_BLOCKS] for i in range(0, len(keys), BATCH_BLOCKS)]
        if not batches:
            return []
        blocks: list[ReadBlock] = []
        pending = None  # the next batch's LocateBlocks, in flight
        offset = 0  # into ``out``
        for i, batch in enumerate(batches):
            # Leased before any byte is copied: the slots stay put.
            locations = pending.result() if pending else self.client.locate_blocks(batch, request_id, ttl_s)
            complete = len(locations) == len(batch)
            pending = None
            if complete and i + 1 < len(batches):
                pending = self._call_async(self.client.locate_blocks, batches[i + 1], request_id, ttl_s)
            blocks += self._copy_out(locations, out, offset)
            offset += sum(loc.block_bytes for loc in locations)
            if not complete:
                break
        return blocks

    def read_views(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float) -> list[ReadBlock]:
        locations = self.client.locate_blocks(keys, request_id, ttl_s)  # leased: slots stay put
        if not locations:
            return []
        view = self._mapping()
        return [ReadBlock(view[loc.offset_bytes : loc.offset_bytes + loc.block_bytes], loc.checksum, loc.lease_id)
                for loc in locations]

    def write(
        self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
        request_id: str, ttl_s: float,
    ) -> tuple[int, int]:
        """Reserves in batches (the next batch's ReserveBlocks in flight while this one is
        copied), commits every block with one CommitBlocks; any failure rolls back all of them."""
        if not keys:
            return 0, 0
        views = [memoryview(p).cast("B") for p in payloads]
        sizes = {len(v) for v in views}
        if len(sizes) != 1:
            raise ValueError(f"shm writes blocks of one size, got sizes {sorted(sizes)}")
        block_bytes = sizes.pop()
        starts = range(0, len(keys), BATCH_BLOCKS)

        def reserve(start: int) -> list[ReservedBlock]:
            end = start + BATCH_BLOCKS
            return self.client.reserve_blocks(keys[start:end], block_bytes, checksums[start:end], request_id, ttl_s)

        ids: list[int] = []
        num_duplicates = 0
        pending = None  # the next batch's ReserveBlocks, in flight
        try:
            for start in starts:
                reserved = pending.result() if pending is not None else reserve(start)
                pending = None
                ids += [r.reservation_id for r in reserved if not r.duplicate]
                num_duplicates += sum(r.duplicate for r in reserved)
                if start + BATCH_BLOCKS < len(keys):
                    pending = self._call_async(reserve, start + BATCH_BLOCKS)
                self._copy_in(reserved, views[start : start + BATCH_BLOCKS], block_bytes)
            return self.client.commit_blocks(ids), num_duplicates
        except BaseException:
            if pending is not None:  # a reservation in flight is rolled back too
                try:
                    ids += [r.reservation_id for r in pending.result() if not r.duplicate]
                except Exception:
                    pass
            try:
                self.client.commit_blocks(ids, abort=True)
            except Exception:  # the pool is gone or slow: its reservation expiry rolls back
                log.warning("could not roll back %d reserved blocks", len(ids), exc_info=True)
            raise

    def _copy_in(self, reserved: Sequence[ReservedBlock], views: Sequence[memoryview], block_bytes: int) -> None:
        """Copies each non-duplicate block into its reserved slot (numpy: the GIL is released)."""
        dst = np.frombuffer(self._mapping(), dtype=np.uint8)
        for r, view in zip(reserved, views):
            if not r.duplicate:
                dst[r.offset_bytes : r.offset_bytes + block_bytes] = np.frombuffer(view, dtype=np.uint8)

    def _call_async(self, fn, *args):
        """``fn(*args)`` on this backend's RPC thread: a pipelined transfer's next LocateBlocks or
        ReserveBlocks while the caller copies the batch before."""
        with self._lock:
            if self._rpc is None:
                self._rpc = ThreadPoolExecutor(1, thread_name_prefix="shm-rpc")
        return self._rpc.submit(fn, *args)

    def _copy_out(self, locations: Sequence[BlockLocation], out: memoryview | None, offset: int) -> list[ReadBlock]:
        """Copies located blocks into ``out`` from ``offset`` on (one copy per run of adjacent
        slots), or into new ``bytes`` each."""
        view = self._mapping()
        if out is None:
            return [ReadBlock(bytes(view[loc.offset_bytes : loc.offset_bytes + loc.block_bytes]), loc.checksum,
                              loc.lease_id) for loc in locations]
        total = sum(loc.block_bytes for loc in locations)
        if offset + total > len(out):
            raise ValueError(f"read buffer of {len(out)} bytes is too small for {offset + total}")
        src, dst = np.frombuffer(view, dtype=np.uint8), np.frombuffer(out, dtype=np.uint8)
        start, pos = 0, offset
        for end in _run_ends(locations):
            first, last = locations[start], locations[end - 1]
            run = src[first.offset_bytes : last.offset_bytes + last.block_bytes]
            dst[pos : pos + len(run)] = run  # one memcpy, the GIL released
            pos, start = pos + len(run), end
        blocks = []
        for loc in locations:
            blocks.append(ReadBlock(out[offset : offset + loc.block_bytes], loc.checksum, loc.lease_id))
            offset += loc.block_bytes
        return blocks

    def close(self) -> None:
        """Unmaps the arena; views handed out by ``read_views`` keep it mapped until they go."""
        if self._rpc is not None:
            self._rpc.shutdown(wait=True)
            self._rpc = None
        view, buffer, self._view, self._buffer = self._view, self._buffer, None, None
        try:
            if view is not None:
                view.release()
            if buffer is not None:
                buffer.close()
        except BufferError:  # a view is still alive: the mapping goes with the last one
            pass

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


def _run_ends(locations: Sequence[BlockLocation]) -> list[int]:
    """Exclusive end indices of the runs of ``locations`` in adjacent arena slots, in order."""
    ends = []
    for i in range(1, len(locations)):
        prev = locations[i - 1]
        if locations[i].offset_bytes != prev.offset_bytes + prev.block_bytes:
            ends.append(i)
    ends.append(len(locations))
    return ends
