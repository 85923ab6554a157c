"""Which requests hold which pool blocks, and until when (docs/design.md §5). Knows no bytes.

A request's entry lives while it holds a lease or owns a request-scoped block; its deadline only
moves later (every lease and every scoped reservation extends it). When the deadline lapses the
block store releases the request as if the client had called ``ReleaseRequest``.

Each entry has a ``lease_id``, new for every entry the table creates: a reader that sees the same
id before and after its copy knows the request held its blocks throughout (nothing released them
in between, so no slot was freed or reused); a different id or none means they may have been.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from core.block_key import BlockKey


@dataclass(eq=False)
class _RequestLeases:
    deadline_s: float  # on the table's monotonic clock
    lease_id: int  # unique per entry of this table (> 0)
    # Dicts as ordered sets: released blocks rejoin the LRU in the order they were leased.
    leased: dict[BlockKey, None] = field(default_factory=dict)
    scoped: dict[BlockKey, None] = field(default_factory=dict)  # its own scoped blocks, any state


@dataclass(frozen=True)
class Released:
    """What ``LeaseTable.release`` dropped."""

    num_leases: int  # block leases the request held
    unleased_keys: list[BlockKey]  # blocks that no request holds any more
    scoped_keys: list[BlockKey]  # the request's scoped blocks, for the store to free


class LeaseTable:
    """Lease sets and deadlines per request_id; ``clock`` returns monotonic seconds."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._requests: dict[str, _RequestLeases] = {}
        self._holders: dict[BlockKey, set[str]] = {}  # leased key -> request_ids
        self.num_leases = 0  # requests holding at least one lease
        self._last_lease_id = 0

    @property
    def num_leased_blocks(self) -> int:
        return len(self._holders)

    def is_leased(self, key: BlockKey) -> bool:
        return key in self._holders

    def extend(self, request_id: str, ttl_s: float) -> None:
        """Makes the request's deadline at least now + ``ttl_s``. Mutates: the request's entry."""
        deadline_s = self._clock() + ttl_s
        state = self._requests.get(request_id)
        if state is None:
            self._last_lease_id += 1
            state = self._requests[request_id] = _RequestLeases(deadline_s, self._last_lease_id)
        state.deadline_s = max(state.deadline_s, deadline_s)

    def lease_id(self, request_id: str) -> int:
        """The id of the request's entry; 0 when it has none. Mutates nothing."""
        state = self._requests.get(request_id)
        return state.lease_id if state is not None else 0

    def renew(self, request_id: str, lease_id: int, ttl_s: float) -> bool:
        """Extends the request's deadline to at least now + ``ttl_s`` if its entry is still the
        one named ``lease_id`` (0: whichever it has); False (mutating nothing, creating nothing)
        when it is gone or another one. Mutates: the entry's deadline."""
        state = self._requests.get(request_id)
        if state is None or (lease_id and state.lease_id != lease_id):
            return False
        state.deadline_s = max(state.deadline_s, self._clock() + ttl_s)
        return True

    def lease(self, request_id: str, key: BlockKey) -> bool:
        """Leases ``key`` to ``request_id`` (``extend`` it first).

        Returns True when ``key`` had no holder before. Mutates: lease sets.
        """
        state = self._requests[request_id]
        if key in state.leased:
            return False
        if not state.leased:
            self.num_leases += 1
        state.leased[key] = None
        holders = self._holders.setdefault(key, set())
        holders.add(request_id)
        return len(holders) == 1

    def add_scoped(self, key: BlockKey, ttl_s: float) -> None:
        """Records that ``key.request_id`` owns the scoped ``key``; extends its deadline."""
        self.extend(key.request_id, ttl_s)
        self._requests[key.request_id].scoped[key] = None

    def forget_block(self, key: BlockKey) -> None:
        """The block is gone: drops every lease on it and its owner's claim. Mutates: lease sets."""
        for request_id in self._holders.pop(key, ()):
            state = self._requests[request_id]
            del state.leased[key]
            if not state.leased:
                self.num_leases -= 1
            self.drop_if_idle(request_id)
        if key.is_scoped and key.request_id in self._requests:
            self._requests[key.request_id].scoped.pop(key, None)
            self.drop_if_idle(key.request_id)

    def release(self, request_id: str) -> Released:
        """Forgets ``request_id`` and its leases; idempotent. Mutates: lease sets, entries."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return Released(0, [], [])
        unleased: list[BlockKey] = []
        for key in state.leased:
            holders = self._holders[key]
            holders.discard(request_id)
            if not holders:
                del self._holders[key]
                unleased.append(key)
        if state.leased:
            self.num_leases -= 1
        return Released(len(state.leased), unleased, list(state.scoped))

    def lapsed(self, now_s: float | None = None) -> list[str]:
        """Requests whose deadline is <= ``now_s`` (default: the clock). Mutates nothing."""
        now_s = self._clock() if now_s is None else now_s
        return [rid for rid, state in self._requests.items() if state.deadline_s <= now_s]

    def drop_if_idle(self, request_id: str) -> None:
        """Forgets a request that holds nothing. Mutates: entries."""
        state = self._requests.get(request_id)
        if state is not None and not state.leased and not state.scoped:
            del self._requests[request_id]
