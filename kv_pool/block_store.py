"""The DRAM block store: a pure data structure, no I/O (docs/design.md §4-§5).

Life of a block::

    reserve ──► WRITING ──write()*──► commit ──► STORED ──(LRU, unleased, content only)──► evicted
                   │                                │
                   └────────── abort ───► gone      └── scoped: freed by release_request / expiry

Bytes live in a DRAM :class:`~kv_pool.arena.Arena` (one shared-memory buffer of block slots);
slots, tiers and the moves between them are :mod:`kv_pool.tiers`, when DRAM evicts (LRU with a
high/low watermark) is :mod:`kv_pool.eviction`. With an NVMe tier, eviction *demotes* a content
block to NVMe instead of dropping it; a later hit reads it back and promotes it to DRAM (the
tiers are exclusive). This module adds reservations, leases and request lifetimes. Leases and
reservations always refer to DRAM blocks, so a peer copying straight out of the arena is safe
while it holds a lease.

A WRITING block holds its bytes (they count as used) but is invisible to ``lookup`` and ``get``.
Content-addressed blocks (``BlockKey.block_hash``) are shared by every request and evicted least
recently used first, never while leased. Request-scoped blocks (``BlockKey.request_id``) are never
indexed or evicted: they die with their request (``release_request`` or its deadline in
``expire``). A request's deadline is extended by every lease it takes and every scoped block it
reserves, so nothing is stranded when a client dies.

Not thread-safe: call every method from one thread (the server's event loop). ``stats()`` only
reads counters and may be called from another thread (the metrics exporter).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from core.block_key import BlockKey
from kv_pool.arena import Arena
from kv_pool.block_types import (
    DUPLICATE,
    BlockEvent,
    BlockLocation,
    BlockState,
    Duplicate,
    PoolFullError,
    PoolStats,
    Reservation,
    StaleReservationError,
)
from kv_pool.eviction import ON_DEMAND, Watermarks
from kv_pool.leases import LeaseTable
from kv_pool.nvme_tier import NvmeTier
from kv_pool.tiers import DramBlock, Tiers

__all__ = [
    "DUPLICATE",
    "BlockEvent",
    "BlockLocation",
    "BlockState",
    "BlockStore",
    "PoolFullError",
    "PoolStats",
    "Reservation",
    "StaleReservationError",
]


class BlockStore:
    """Blocks keyed by :class:`BlockKey` in ``capacity_bytes`` of DRAM.

    ``clock`` returns monotonic seconds (inject a fake one in tests); ``default_ttl_s`` is the
    lifetime given to a request that reserves a scoped block without holding a lease. ``arena``
    (default: anonymous memory of ``capacity_bytes``) holds the bytes; ``nvme`` is the optional
    tier below DRAM; ``watermarks`` say when DRAM evicts (:mod:`kv_pool.eviction`; default: only
    when a block does not fit). The store owns arena and tier (``close``).

    Raises:
        ValueError: quoting the value, for a capacity or ttl <= 0 or an arena of another size.
    """

    def __init__(
        self,
        capacity_bytes: int,
        default_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[BlockEvent], None] | None = None,
        arena: Arena | None = None,
        nvme: NvmeTier | None = None,
        watermarks: Watermarks = ON_DEMAND,
    ):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes!r}")
        if default_ttl_s <= 0:
            raise ValueError(f"default_ttl_s must be > 0, got {default_ttl_s!r}")
        if arena is not None and arena.capacity_bytes != capacity_bytes:
            raise ValueError(f"arena of {arena.capacity_bytes} bytes for capacity_bytes {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.default_ttl_s = default_ttl_s
        arena = arena if arena is not None else Arena(capacity_bytes)
        self._tiers = Tiers(capacity_bytes, arena, nvme, watermarks, on_event)
        self._leases = LeaseTable(clock)
        self._num_corrupt = 0

    @property
    def arena(self) -> Arena:
        return self._tiers.arena

    @property
    def nvme(self) -> NvmeTier | None:
        return self._tiers.nvme

    # -- two-phase put ---------------------------------------------------------------------------

    def reserve(self, key: BlockKey, block_bytes: int, checksum: int = 0, ttl_s: float = 0.0) -> Reservation | Duplicate:
        """Reserves an arena slot of ``block_bytes`` for ``key`` in state WRITING, evicting (or
        demoting) LRU blocks for room. ``checksum`` is the writer's, kept for readers to verify.

        Placing it past the high watermark first evicts LRU blocks down to the low one.
        Returns ``DUPLICATE`` (mutating nothing) when ``key`` is already stored (in any tier) or
        being written: the second writer's put succeeds without a second copy.

        Mutates: block table, used bytes, LRU (evictions); a scoped key extends its request's
        deadline to at least now + ``ttl_s`` (seconds: the writer's lease TTL, so that a writer
        that dies holds its request's tail no longer than its leases; 0: ``default_ttl_s``).

        Raises:
            ValueError: ``block_bytes`` <= 0 or an empty spec fingerprint.
            PoolFullError: no room can be made without touching leased, scoped or WRITING blocks.
        """
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be > 0, got {block_bytes!r}")
        if ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s!r}")
        if not key.spec_fingerprint:
            raise ValueError(f"spec_fingerprint must not be empty: {key}")
        if self._tiers.holds_anywhere(key):
            return DUPLICATE
        reservation = Reservation(key, block_bytes)
        self._tiers.place(key, block_bytes, reservation, checksum)
        if key.is_scoped:
            self._leases.add_scoped(key, ttl_s or self.default_ttl_s)
        return reservation

    def write(self, reservation: Reservation, offset_bytes: int, data: bytes | memoryview) -> None:
        """Copies ``data`` into the reserved block at ``offset_bytes``; chunks arrive in order.

        Mutates: the block's bytes and its written count.

        Raises:
            StaleReservationError: the reservation is no longer live.
            ValueError: ``offset_bytes`` is not where the previous chunk ended, or the chunk
                runs past ``block_bytes``.
        """
        block = self._live(reservation)
        end = offset_bytes + len(data)
        if offset_bytes != block.written_bytes:
            raise ValueError(f"{block.key}: chunk at offset {offset_bytes}, expected {block.written_bytes}")
        if end > reservation.block_bytes:
            raise ValueError(f"{block.key}: chunk ends at {end}, past block_bytes {reservation.block_bytes}")
        self._tiers.view(block)[offset_bytes:end] = data
        block.written_bytes = end

    def mark_written(self, reservation: Reservation) -> None:
        """A peer wrote the whole block straight into its arena slot (shm, NIXL).

        Mutates: the block's written count. Raises StaleReservationError.
        """
        self._live(reservation).written_bytes = reservation.block_bytes

    def commit(self, reservation: Reservation) -> None:
        """Makes the block STORED and visible; a content block becomes evictable unless leased.

        Mutates: block state, LRU (most recently used), counts; reports a "stored" event for a
        content-addressed block.

        Raises:
            StaleReservationError: the reservation is no longer live.
            ValueError: not every byte was written.
        """
        block = self._live(reservation)
        if block.written_bytes != reservation.block_bytes:
            raise ValueError(f"{block.key}: commit after {block.written_bytes} of {reservation.block_bytes} bytes")
        self._tiers.mark_committed(block, evictable=not self._leases.is_leased(block.key))

    def abort(self, reservation: Reservation) -> bool:
        """Rolls a WRITING block back: it was never visible and its bytes are freed.

        Returns False (mutating nothing) when the reservation is no longer live.
        Mutates: block table, used bytes, leases on the block.
        """
        block = self._tiers.blocks.get(reservation.key)
        if block is None or block.reservation is not reservation:
            return False
        self._free(block)
        return True

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> bytes:
        """A copy of a STORED content or scoped block's bytes; an NVMe hit is promoted to DRAM
        when there is room (else read from NVMe in place).

        Mutates: LRU (the block becomes most recently used), tiers, hit counters.

        Raises:
            KeyError: ``key`` is not stored (unknown, evicted, or still WRITING).
        """
        block = self._tiers.find(key)
        if block is None:
            if self.nvme is None or key not in self.nvme:
                raise KeyError(key)
            return self.nvme.read(key)
        self._tiers.evictable.touch(key)
        return bytes(self._tiers.view(block))

    def checksum(self, key: BlockKey) -> int:
        """The writer's checksum of a held block (0: none). Mutates nothing. Raises KeyError."""
        block = self._tiers.blocks.get(key)
        if block is not None:
            return block.checksum
        if self.nvme is not None:
            return self.nvme.checksum(key)
        raise KeyError(key)

    def locate(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float) -> list[BlockLocation]:
        """Leases the longest STORED prefix of ``keys`` to ``request_id`` (promoting NVMe blocks to
        DRAM) and says where each is in the arena; the slots stay put while the lease lives.

        Mutates: tiers, leases, LRU, hit counters. Raises ValueError as ``lease``.
        """
        self._validate_lease(request_id, ttl_s)
        self._leases.extend(request_id, ttl_s)
        found: list[BlockLocation] = []
        for key in keys:
            block = self._tiers.find(key)
            if block is None:
                break
            # Leased at once: promoting the next block must not demote this one.
            if self._leases.lease(request_id, key):
                self._tiers.evictable.discard(key)
            found.append(BlockLocation(block.offset_bytes, block.num_bytes, block.checksum))
        self._leases.drop_if_idle(request_id)
        return found

    def drop_corrupt(self, key: BlockKey) -> bool:
        """Removes a block whose bytes failed verification, from whichever tier holds it; leases
        on it are dropped. Returns False when the pool did not hold it (or it is WRITING).

        Mutates: tiers, leases, the corrupt counter; reports "evicted".
        """
        block = self._tiers.blocks.get(key)
        if block is not None and block.reservation is None:
            self._free(block)
        elif not self._tiers.discard_nvme(key):
            return False
        self._num_corrupt += 1
        return True

    def block_state(self, key: BlockKey) -> BlockState | None:
        """State of ``key``, or None when the pool does not hold it. Mutates nothing."""
        block = self._tiers.blocks.get(key)
        if block is None:
            return None
        return BlockState.WRITING if block.reservation is not None else BlockState.STORED

    # -- leases and request lifetime -------------------------------------------------------------

    def lease(self, keys: Iterable[BlockKey], request_id: str, ttl_s: float) -> int:
        """Leases every held key (WRITING or STORED) to ``request_id``; returns how many.

        A leased block is never evicted. A key on NVMe is promoted to DRAM first (skipped when
        DRAM has no room). The request's deadline becomes at least now + ``ttl_s``.
        Mutates: lease sets, LRU (leased blocks leave it), the request's deadline, tiers.

        Raises:
            ValueError: empty ``request_id`` or ``ttl_s`` <= 0.
        """
        self._validate_lease(request_id, ttl_s)
        self._leases.extend(request_id, ttl_s)
        num_leased = 0
        for key in keys:
            if key not in self._tiers.blocks and self._tiers.promote(key) is None:
                continue
            num_leased += 1
            if self._leases.lease(request_id, key):
                self._tiers.evictable.discard(key)
        self._leases.drop_if_idle(request_id)
        return num_leased

    def lease_id(self, request_id: str) -> int:
        """The id of ``request_id``'s lease (the same from its first lease or scoped block until it
        is released or lapses); 0 when it holds nothing. Mutates nothing."""
        return self._leases.lease_id(request_id)

    def renew_lease(self, request_id: str, lease_id: int, ttl_s: float) -> bool:
        """Moves the deadline of lease ``lease_id`` of ``request_id`` to at least now + ``ttl_s``
        (a read of its blocks is still running). False, mutating nothing, when that lease is
        gone: bytes read under it may have been freed or reused since.

        Mutates: the request's deadline. Raises ValueError as ``lease``.
        """
        self._validate_lease(request_id, ttl_s)
        return self._leases.renew(request_id, lease_id, ttl_s)

    def release_request(self, request_id: str) -> tuple[int, int]:
        """Ends ``request_id`` in the pool: drops its leases and frees its scoped blocks.

        Idempotent. Returns (leases dropped, scoped blocks freed).
        Mutates: lease sets, LRU (unleased content blocks return as most recently used), block
        table and used bytes (scoped blocks, WRITING ones included: their reservation goes stale).
        """
        released = self._leases.release(request_id)
        for key in released.unleased_keys:
            block = self._tiers.blocks[key]
            if block.reservation is None and not key.is_scoped:
                self._tiers.evictable.add(key, block.num_bytes)
        for key in released.scoped_keys:
            self._free(self._tiers.blocks[key])
        return released.num_leases, len(released.scoped_keys)

    def expire(self, now_s: float | None = None) -> list[str]:
        """Releases every request whose deadline is <= ``now_s`` (default: the clock).

        Returns the released request_ids. Mutates: as ``release_request``.
        """
        lapsed = self._leases.lapsed(now_s)
        for request_id in lapsed:
            self.release_request(request_id)
        return lapsed

    def index_events(self) -> list[BlockEvent]:
        """One "stored" / "demoted" event per block this node can serve (kv_pool.tiers)."""
        return self._tiers.index_events()

    def stats(self) -> PoolStats:
        """Current counts; reads counters only. Mutates nothing."""
        t, c, nvme = self._tiers, self._tiers.counters, self.nvme
        return PoolStats(
            capacity_bytes=self.capacity_bytes,
            used_bytes=t.used_bytes,
            num_writing_blocks=t.num_writing,
            num_stored_blocks=t.num_stored,
            num_leased_blocks=self._leases.num_leased_blocks,
            num_scoped_blocks=t.num_scoped,
            num_leases=self._leases.num_leases,
            num_evicted_blocks=c.num_evicted,
            num_dram_blocks=len(t.blocks),
            num_dram_hits=c.num_dram_hits,
            num_dram_misses=c.num_dram_misses,
            nvme_capacity_bytes=nvme.capacity_bytes if nvme is not None else 0,
            nvme_used_bytes=nvme.used_bytes if nvme is not None else 0,
            num_nvme_blocks=len(nvme) if nvme is not None else 0,
            num_nvme_hits=c.num_nvme_hits,
            num_nvme_misses=c.num_nvme_misses,
            num_nvme_evictions=nvme.num_evicted_blocks if nvme is not None else 0,
            num_nvme_promotions=c.num_promotions,
            num_nvme_demotions=c.num_demotions,
            num_corrupt_blocks=self._num_corrupt,
        )

    def close(self) -> None:
        """Releases the arena and the NVMe file. The store must not be used afterwards."""
        self._tiers.close()

    # -- internals -------------------------------------------------------------------------------

    def _live(self, reservation: Reservation) -> DramBlock:
        block = self._tiers.blocks.get(reservation.key)
        if block is None or block.reservation is not reservation:
            raise StaleReservationError(f"reservation of {reservation.key} is no longer live")
        return block

    def _free(self, block: DramBlock) -> None:
        """Removes ``block`` in any state, dropping the leases every request holds on it."""
        self._leases.forget_block(block.key)
        self._tiers.free(block)

    @staticmethod
    def _validate_lease(request_id: str, ttl_s: float) -> None:
        if not request_id:
            raise ValueError("request_id must not be empty")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
