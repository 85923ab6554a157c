"""The NVMe tier: content-addressed blocks that DRAM evicted, in one preallocated file.

``blocks.bin`` in the tier's directory is cut into extents like the DRAM arena
(:class:`kv_pool.arena.ExtentAllocator`); a block is written with one write when DRAM demotes it
and read with one read when a hit promotes it back (``os.pwrite`` / ``os.pread``, or NIXL's
POSIX backend: :mod:`kv_pool.nvme_io`) (then it leaves this tier:
the tiers are exclusive, a block lives in exactly one). When the file is full the least recently
used blocks here are dropped for good.

Holds no leases and no request-scoped blocks: only STORED content blocks, all evictable.
Not thread-safe; owned by the block store.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from core.block_key import BlockKey
from kv_pool.arena import ExtentAllocator
from kv_pool.lru import LruSet
from kv_pool.nvme_io import NVME_IO_MODES, NixlFileIO, OsFileIO

FILE_NAME = "blocks.bin"


@dataclass(frozen=True)
class NvmeBlock:
    offset_bytes: int
    num_bytes: int
    checksum: int  # the writer's, 0 when it gave none


class NvmeTier:
    """``capacity_bytes`` of block storage under directory ``path`` (created if missing).

    ``io``: "os" or "nixl" (:mod:`kv_pool.nvme_io`); ``dram``: the DRAM arena's buffer, which
    the nixl I/O registers so demotions write straight from it.

    Raises:
        ValueError: quoting the value, for a capacity <= 0 or an unknown ``io``.
        ImportError: ``io`` "nixl" without the nixl package.
    """

    def __init__(self, path: str, capacity_bytes: int, io: str = "os", dram=None):
        if capacity_bytes <= 0:
            raise ValueError(f"nvme capacity_bytes must be > 0, got {capacity_bytes!r}")
        if io not in NVME_IO_MODES:
            raise ValueError(f"nvme io must be one of {NVME_IO_MODES}, got {io!r}")
        os.makedirs(path, exist_ok=True)
        self.path = os.path.join(path, FILE_NAME)
        self.capacity_bytes = capacity_bytes
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self._fd, capacity_bytes)
        try:
            self._io = OsFileIO(self._fd, self.path) if io == "os" else NixlFileIO(
                self._fd, self.path, capacity_bytes, dram)
        except BaseException:
            self.close()
            raise
        self.io = io
        self._allocator = ExtentAllocator(capacity_bytes)
        self._blocks: dict[BlockKey, NvmeBlock] = {}
        self._lru = LruSet()
        self.used_bytes = 0
        self.num_evicted_blocks = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self._blocks

    def keys(self) -> list[BlockKey]:
        """Every block on this tier, least recently used first. Mutates nothing."""
        return list(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def put(self, key: BlockKey, data: bytes | memoryview, checksum: int) -> list[BlockKey]:
        """Writes ``data`` as ``key``, dropping least recently used blocks for room.

        Returns the dropped keys (empty, or ``[key]`` itself when it can never fit).
        Mutates: the file, the extent table, the LRU.
        """
        num_bytes = len(data)
        if num_bytes > self.capacity_bytes:
            return [key]
        dropped: list[BlockKey] = []
        offset = self._allocator.allocate(num_bytes)
        while offset is None:
            dropped.append(self._lru.pop_oldest())  # non-empty: everything here is evictable
            self._remove(dropped[-1])
            self.num_evicted_blocks += 1
            offset = self._allocator.allocate(num_bytes)
        try:
            self._io.write(offset, data)
        except OSError:
            self._allocator.free(offset, num_bytes)
            raise
        self._blocks[key] = NvmeBlock(offset, num_bytes, checksum)
        self._lru.add(key, num_bytes)
        self.used_bytes += num_bytes
        return dropped

    def checksum(self, key: BlockKey) -> int:
        """The writer's checksum of ``key``. Mutates nothing. Raises KeyError."""
        return self._blocks[key].checksum

    def take(self, key: BlockKey) -> tuple[bytes, int]:
        """Reads ``key`` back and removes it from this tier; returns (bytes, checksum).

        Mutates: the extent table, the LRU. Raises KeyError when ``key`` is not here.
        """
        block = self._blocks[key]
        data = self.read(key)
        self._remove(key)
        return data, block.checksum

    def read(self, key: BlockKey) -> bytes:
        """The bytes of ``key``, leaving it here. Mutates: LRU. Raises KeyError, OSError."""
        block = self._blocks[key]
        data = self._io.read(block.offset_bytes, block.num_bytes)
        self._lru.touch(key)
        return data

    def discard(self, key: BlockKey) -> bool:
        """Drops ``key`` if held. Mutates: the extent table, the LRU."""
        if key not in self._blocks:
            return False
        self._remove(key)
        return True

    def close(self) -> None:
        """Closes and deletes the file. Idempotent."""
        if getattr(self, "_io", None) is not None:
            self._io.close()
            self._io = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            os.unlink(self.path)

    def _remove(self, key: BlockKey) -> None:
        block = self._blocks.pop(key)
        self._lru.discard(key)
        self._allocator.free(block.offset_bytes, block.num_bytes)
        self.used_bytes -= block.num_bytes
