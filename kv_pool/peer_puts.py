"""Two-phase puts whose bytes a peer writes itself (shared memory, NIXL), held across RPCs.

    ReserveBlocks ──► reservation ids + arena offsets ──► peer writes the slots ──► CommitBlocks
                                                    └──(abort, or ttl lapses)──► rolled back

A reservation is a :class:`~kv_pool.block_types.Reservation` of the block store (the block is
WRITING, invisible) plus a deadline; the pool's expiry loop rolls back the ones whose peer died.
Not thread-safe: the server's event loop calls it, like the store.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from core.block_key import BlockKey
from kv_pool.block_store import DUPLICATE, BlockStore, PoolFullError, Reservation


@dataclass(frozen=True)
class Reserved:
    """The answer for one key of ``reserve``."""

    duplicate: bool  # already stored or being written: the peer skips it
    offset_bytes: int
    reservation_id: int  # 0 for a duplicate


@dataclass(eq=False)
class _Pending:
    reservation: Reservation
    deadline_s: float
    lease_request_id: str
    lease_ttl_s: float


class PeerPuts:
    """Open peer reservations of one store; ``ttl_s`` bounds how long a peer may take to write."""

    def __init__(self, store: BlockStore, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._pending)

    def reserve(
        self, keys: Sequence[BlockKey], block_bytes: int, checksums: Sequence[int],
        lease_request_id: str, lease_ttl_s: float,
    ) -> list[Reserved]:
        """Reserves every key, all or nothing; duplicates are leased at once when asked.

        Mutates: the store (reservations, leases), the pending table.

        Raises:
            ValueError: ``checksums`` neither empty nor one per key, or as ``BlockStore.reserve``.
            PoolFullError: no room for all of them (nothing stays reserved).
        """
        if checksums and len(checksums) != len(keys):
            raise ValueError(f"{len(checksums)} checksums for {len(keys)} keys")
        answers: list[Reserved] = []
        try:
            for i, key in enumerate(keys):
                reservation = self._store.reserve(key, block_bytes, checksums[i] if checksums else 0,
                                                  lease_ttl_s if lease_request_id else 0.0)
                if reservation is DUPLICATE:
                    answers.append(Reserved(True, 0, 0))
                    continue
                reservation_id = next(self._ids)
                deadline_s = self._clock() + self._ttl_s
                self._pending[reservation_id] = _Pending(reservation, deadline_s, lease_request_id, lease_ttl_s)
                answers.append(Reserved(False, reservation.offset_bytes, reservation_id))
        except (ValueError, PoolFullError):
            self.abort([a.reservation_id for a in answers if not a.duplicate])
            raise
        if lease_request_id:
            duplicates = [key for key, a in zip(keys, answers) if a.duplicate]
            self._store.lease(duplicates, lease_request_id, lease_ttl_s)
        return answers

    def commit(self, reservation_ids: Sequence[int]) -> list[Reservation]:
        """Commits the peer-written blocks; returns those that became visible.

        Unknown ids (expired, aborted, or released with a scoped block's request) are skipped.
        Mutates: the store (commit, lease), the pending table.
        """
        committed = []
        for reservation_id in reservation_ids:
            pending = self._pending.pop(reservation_id, None)
            if pending is None or self._store.block_state(pending.reservation.key) is None:
                continue
            try:
                self._store.mark_written(pending.reservation)
                self._store.commit(pending.reservation)
            except Exception:  # stale: the scoped block's request ended meanwhile
                continue
            committed.append(pending.reservation)
            if pending.lease_request_id:
                self._store.lease([pending.reservation.key], pending.lease_request_id, pending.lease_ttl_s)
        return committed

    def abort(self, reservation_ids: Sequence[int]) -> None:
        """Rolls the reservations back; unknown ids are ignored. Mutates: store, table."""
        for reservation_id in reservation_ids:
            pending = self._pending.pop(reservation_id, None)
            if pending is not None:
                self._store.abort(pending.reservation)

    def expire(self, now_s: float | None = None) -> int:
        """Rolls back reservations past their deadline; returns how many. Mutates: as ``abort``."""
        now_s = self._clock() if now_s is None else now_s
        lapsed = [rid for rid, pending in self._pending.items() if pending.deadline_s <= now_s]
        self.abort(lapsed)
        return len(lapsed)
