"""The storage under the block store: DRAM slots (arena + block table) over an optional NVMe
tier, and the moves between them (docs/design.md §1, "DRAM + NVMe").

    place ──► DRAM slot ──(LRU eviction, kv_pool.eviction)──► demoted to NVMe ──(full)──► dropped
                  ▲                                                 │
                  └───────────────── promoted on a hit ◄────────────┘

The tiers are exclusive: a block lives in exactly one. Only evictable blocks (the ``evictable``
LRU set: STORED, content-addressed, unleased) ever leave DRAM by eviction; which blocks are
evictable is the block store's business (it knows the leases), as are reservations. Counts by
state and per-tier counters live here because every move changes them.

Not thread-safe: owned by the block store (one event loop thread).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from core.block_key import BlockKey
from kv_pool.arena import Arena
from kv_pool.block_types import BlockEvent, PoolFullError, Reservation
from kv_pool.eviction import ON_DEMAND, Watermarks, num_bytes_to_evict, pick_victims
from kv_pool.lru import LruSet
from kv_pool.nvme_tier import NvmeTier


@dataclass(eq=False)
class DramBlock:
    key: BlockKey
    offset_bytes: int  # of its slot in the arena
    num_bytes: int
    reservation: Reservation | None  # set while WRITING
    checksum: int = 0  # the writer's (core.kv_transfer.checksum), 0 when it gave none
    written_bytes: int = 0


@dataclass
class TierCounters:
    """Cumulative counts (``PoolStats`` fields of the same meaning)."""

    num_evicted: int = 0  # left DRAM by eviction (demoted or dropped)
    num_dram_hits: int = 0
    num_dram_misses: int = 0
    num_nvme_hits: int = 0
    num_nvme_misses: int = 0
    num_promotions: int = 0
    num_demotions: int = 0


class Tiers:
    """``capacity_bytes`` of DRAM in ``arena``, ``nvme`` below it (or None), evicting by
    ``watermarks``; ``emit`` receives "stored" / "demoted" / "evicted" index events."""

    def __init__(
        self, capacity_bytes: int, arena: Arena, nvme: NvmeTier | None, watermarks: Watermarks = ON_DEMAND,
        emit: Callable[[BlockEvent], None] | None = None,
    ):
        self.capacity_bytes = capacity_bytes
        self.arena = arena
        self.nvme = nvme
        self.watermarks = watermarks
        self._emit_fn = emit
        self.blocks: dict[BlockKey, DramBlock] = {}  # every DRAM block, any state
        self.evictable = LruSet()  # STORED content-addressed blocks that no lease holds
        self.used_bytes = 0
        self.num_writing = self.num_stored = self.num_scoped = 0
        self.counters = TierCounters()

    def holds_anywhere(self, key: BlockKey) -> bool:
        """Whether either tier has ``key`` in any state. Mutates nothing."""
        return key in self.blocks or (self.nvme is not None and key in self.nvme)

    def place(self, key: BlockKey, num_bytes: int, reservation: Reservation, checksum: int) -> DramBlock:
        """A new WRITING block in a DRAM slot, evicting for room (``kv_pool.eviction``).

        Mutates: arena, block table, used bytes, LRU and NVMe (evictions). Raises PoolFullError.
        """
        offset = self.make_room(num_bytes)
        reservation.offset_bytes = offset
        block = DramBlock(key, offset, num_bytes, reservation, checksum)
        self.blocks[key] = block
        self.used_bytes += num_bytes
        self.num_writing += 1
        return block

    def mark_committed(self, block: DramBlock, evictable: bool) -> None:
        """WRITING -> STORED (content, evictable unless leased) or committed scoped.

        Mutates: state counts, LRU; reports "stored" for a content block.
        """
        block.reservation = None
        self.num_writing -= 1
        if block.key.is_scoped:
            self.num_scoped += 1
            return
        self.num_stored += 1
        if evictable:
            self.evictable.add(block.key, block.num_bytes)
        self._emit("stored", block.key)

    def view(self, block: DramBlock) -> memoryview:
        """The block's bytes in the arena (a view, no copy)."""
        return self.arena.view[block.offset_bytes : block.offset_bytes + block.num_bytes]

    def holds(self, key: BlockKey) -> bool:
        """Whether ``key`` is STORED in some tier, counting a hit or miss per tier asked."""
        block = self.blocks.get(key)
        c = self.counters
        if block is not None and block.reservation is None:
            c.num_dram_hits += 1
            return True
        c.num_dram_misses += 1
        if self.nvme is not None and key in self.nvme:
            c.num_nvme_hits += 1
            return True
        c.num_nvme_misses += self.nvme is not None
        return False

    def find(self, key: BlockKey) -> DramBlock | None:
        """The STORED DRAM block of ``key``, promoting it from NVMe if it is there; counts hits."""
        if not self.holds(key):
            return None
        return self.blocks.get(key) or self.promote(key)

    def promote(self, key: BlockKey) -> DramBlock | None:
        """Moves ``key`` from NVMe into a DRAM slot as a STORED, evictable block.

        Returns None (and leaves the block on NVMe) when it is not there or DRAM has no room.
        Mutates: both tiers, LRU, counts; reports "stored".
        """
        if self.nvme is None or key not in self.nvme:
            return None
        data, checksum = self.nvme.take(key)  # first: making room may demote into NVMe
        try:
            offset = self.make_room(len(data))
        except PoolFullError:
            for dropped in self.nvme.put(key, data, checksum):
                self._emit("evicted", dropped)
            return None
        self.arena.view[offset : offset + len(data)] = data
        block = DramBlock(key, offset, len(data), None, checksum)
        self.blocks[key] = block
        self.used_bytes += len(data)
        self.num_stored += 1
        self.counters.num_promotions += 1
        self.evictable.add(key, len(data))
        self._emit("stored", key)
        return block

    def make_room(self, num_bytes: int) -> int:
        """Evicts LRU blocks so ``num_bytes`` fit (down to the low watermark when placing them
        would pass the high one); returns the new slot's arena offset (allocated).

        Raises:
            PoolFullError: evicting nothing, when the evictable blocks cannot make room.
        """
        free_bytes = self.capacity_bytes - self.used_bytes
        if num_bytes > self.capacity_bytes or num_bytes - free_bytes > self.evictable.total_bytes:
            raise PoolFullError(
                f"no room for a {num_bytes}-byte block: {free_bytes} bytes free, "
                f"{self.evictable.total_bytes} evictable; the rest is leased, scoped or being written"
            )
        to_evict = num_bytes_to_evict(self.used_bytes, num_bytes, self.capacity_bytes, self.watermarks)
        for key in pick_victims(self.evictable, to_evict):
            self._evict(key)
        while True:
            offset = self.arena.allocate(num_bytes)
            if offset is not None:
                return offset
            if not self.evictable:  # only with blocks of mixed sizes: free bytes fragmented
                raise PoolFullError(f"no contiguous room for a {num_bytes}-byte block")
            self._evict(self.evictable.pop_oldest())

    def free(self, block: DramBlock, emit: bool = True) -> None:
        """Removes a DRAM block in any state (leases on it are the caller's to drop).

        Mutates: block table, arena, used bytes, LRU, counts; reports "evicted" for a stored
        content block when ``emit``.
        """
        key = block.key
        self.evictable.discard(key)
        del self.blocks[key]
        self.arena.free(block.offset_bytes, block.num_bytes)
        self.used_bytes -= block.num_bytes
        if block.reservation is not None:
            self.num_writing -= 1
        elif key.is_scoped:
            self.num_scoped -= 1
        else:
            self.num_stored -= 1
            if emit:
                self._emit("evicted", key)

    def index_events(self) -> list[BlockEvent]:
        """What the index must say about this node now: "stored" for every committed
        content-addressed DRAM block, "demoted" for every NVMe block (to rebuild a lost index;
        docs/failover.md). Mutates nothing."""
        events = [BlockEvent("stored", key) for key, block in self.blocks.items()
                  if block.reservation is None and not key.is_scoped]
        if self.nvme is not None:
            events += [BlockEvent("demoted", key) for key in self.nvme.keys()]
        return events

    def discard_nvme(self, key: BlockKey) -> bool:
        """Drops ``key`` from the NVMe tier if it is there; reports "evicted"."""
        if self.nvme is None or not self.nvme.discard(key):
            return False
        self._emit("evicted", key)
        return True

    def close(self) -> None:
        if self.nvme is not None:  # first: its I/O may hold a view of the arena
            self.nvme.close()
        self.arena.close()

    def _evict(self, key: BlockKey) -> None:
        """Demotes an evictable block to NVMe (when there is a tier), else drops it."""
        block = self.blocks[key]
        self.counters.num_evicted += 1
        if self.nvme is None:
            self.free(block)
            return
        dropped = self.nvme.put(key, self.view(block), block.checksum)
        self.free(block, emit=False)
        if key in dropped:  # larger than the whole tier
            self._emit("evicted", key)
            dropped.remove(key)
        else:
            self.counters.num_demotions += 1
            self._emit("demoted", key)
        for other in dropped:
            self._emit("evicted", other)

    def _emit(self, kind: str, key: BlockKey) -> None:
        if self._emit_fn is not None:
            self._emit_fn(BlockEvent(kind, key))
