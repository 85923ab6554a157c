"""The DRAM arena: one buffer of ``capacity_bytes`` cut into block-sized slots.

The buffer is a ``mmap`` of a file (``/dev/shm`` on a Linux host), so a worker on the same host
can map the very same bytes and copy blocks without a socket (``core.kv_transfer.shm``). Without a
path it is anonymous memory (unit tests).

Slots are extents handed out first-fit from a sorted free list that coalesces neighbours. Every
block of one ``KVCacheSpec`` has the same size, so in practice the arena is a slab of equal
slots and never fragments; mixed sizes (tests) work too::

    offset 0                                                      capacity_bytes
    |[slot a][slot b][   free   ][slot c][        free         ]|
"""

from __future__ import annotations

import bisect
import mmap
import os


class ExtentAllocator:
    """Free extents of ``[0, capacity_bytes)``, first-fit. Pure bookkeeping, no bytes."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._lengths: dict[int, int] = {0: capacity_bytes}  # start -> length
        self.free_bytes = capacity_bytes

    def allocate(self, num_bytes: int) -> int | None:
        """Offset of a free extent of ``num_bytes``, or None when none is large enough.

        Mutates: the free list.
        """
        for i, start in enumerate(self._starts):
            length = self._lengths[start]
            if length < num_bytes:
                continue
            del self._lengths[start]
            if length == num_bytes:
                del self._starts[i]
            else:
                self._starts[i] = start + num_bytes
                self._lengths[start + num_bytes] = length - num_bytes
            self.free_bytes -= num_bytes
            return start
        return None

    def free(self, offset: int, num_bytes: int) -> None:
        """Returns an allocated extent, merging it with free neighbours. Mutates: the free list."""
        i = bisect.bisect_left(self._starts, offset)
        self.free_bytes += num_bytes
        if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == offset:
            offset = self._starts[i - 1]  # merge with the extent before
            num_bytes += self._lengths.pop(offset)
            i -= 1
            del self._starts[i]
        if i < len(self._starts) and self._starts[i] == offset + num_bytes:
            num_bytes += self._lengths.pop(self._starts[i])  # merge with the extent after
            del self._starts[i]
        self._starts.insert(i, offset)
        self._lengths[offset] = num_bytes


class Arena:
    """``capacity_bytes`` of block memory, shared through ``path`` when one is given.

    ``path``: the file to create (replacing a stale one) and map; "" maps anonymous memory.
    ``prefault``: commit every page now (``MAP_POPULATE``) instead of on first write; a first
    touch of a tmpfs page costs ~10x a warm copy here. Call ``close`` to unmap and unlink it.
    """

    def __init__(self, capacity_bytes: int, path: str = "", prefault: bool = False):
        self.allocator = ExtentAllocator(capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self.path = path
        if path:
            if os.path.exists(path):
                os.unlink(path)  # a stale arena of a dead node: mappers keep the old inode
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, capacity_bytes)  # sparse: pages are committed when touched
                flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
                self.buffer = mmap.mmap(fd, capacity_bytes, flags=flags)
            finally:
                os.close(fd)
        else:
            flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | (mmap.MAP_POPULATE if prefault else 0)
            self.buffer = mmap.mmap(-1, capacity_bytes, flags=flags)
        self.view = memoryview(self.buffer)  # [capacity_bytes], uint8

    def allocate(self, num_bytes: int) -> int | None:
        return self.allocator.allocate(num_bytes)

    def free(self, offset: int, num_bytes: int) -> None:
        self.allocator.free(offset, num_bytes)

    def close(self) -> None:
        """Unmaps (once no view is alive) and unlinks the file. Idempotent."""
        self.view.release()
        try:
            self.buffer.close()
        except BufferError:  # a view escaped; the mapping goes with the process
            pass
        if self.path and os.path.exists(self.path):
            os.unlink(self.path)
            self.path = ""
