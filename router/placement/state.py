"""The router's placement bookkeeping: one owner that writes it, a read-only view for policies.

A worker's heartbeat is up to a second old. What this router did since then is kept here, so a
burst of requests does not all land on the worker that looked idle:

- in flight: this router's requests running at each worker address (an RPC or stream open);
- pending prefills: prompt tokens it placed at each worker that still wait for their first token;
- awaiting decode: requests it placed at each decode worker whose Decode stream has not opened
  yet (a disaggregated request prefilling elsewhere): without them every request of a burst sees
  the same idle decode workers while the prefills run, and all of them go to one;
- the local prefix view: the block hashes it sent to each worker (router.placement.prefix_index);
- ended work: the requests and prompt tokens it saw end at each worker lately, with the time: a
  heartbeat taken before they ended still counts them, and the Predictor takes them off
  (:meth:`PlacementView.ended_since`), or a worker that just finished looks busy for up to a
  heartbeat and the next request goes elsewhere (to a worker that lacks its prefix).

:class:`PlacementBook` holds all five; only :class:`router.placement.placer.Placer` writes it (at
placement, at each attempt's start and end, at the first token and at the request's end).
Routing policies and the Predictor read it through :class:`PlacementView`, which has readers
only. Everything here runs on the router's event loop (no lock).
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable, Iterator, Sequence

from router.placement.prefix_index import LocalPrefixCache


class InFlightCounter:
    """This router's own requests in flight per worker address."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def get(self, address: str) -> int:
        return self._counts[address]

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Counts one request at ``address`` for the duration of the ``with`` block."""
        self._counts[address] += 1
        try:
            yield
        finally:
            self._counts[address] -= 1
            if self._counts[address] <= 0:
                del self._counts[address]


class PlacedAmounts:
    """An amount per placement, summed per worker address: the prompt tokens waiting for their
    first token (pending prefills), or 1 per request waiting for its Decode stream.

    ``add`` at placement, ``remove`` when it is done (or at the request's end); ``key`` names one
    placement (the router uses the Placement object itself).
    """

    def __init__(self) -> None:
        self._by_key: dict[Hashable, tuple[str, int]] = {}  # key -> (address, tokens)
        self._tokens: Counter[str] = Counter()

    def add(self, key: Hashable, address: str, num_tokens: int) -> None:
        """Counts ``num_tokens`` at ``address`` under ``key`` (replacing an earlier entry of that key)."""
        self.remove(key)
        self._by_key[key] = (address, num_tokens)
        self._tokens[address] += num_tokens

    def remove(self, key: Hashable) -> tuple[str, int] | None:
        """Forgets ``key``; returns its (address, tokens), None when unknown."""
        entry = self._by_key.pop(key, None)
        if entry is not None:
            address, num_tokens = entry
            self._tokens[address] -= num_tokens
            if self._tokens[address] <= 0:
                del self._tokens[address]
        return entry

    def total(self, address: str) -> int:
        """The amounts placed at ``address`` and not yet removed."""
        return self._tokens[address]


# Seconds of ended work kept per worker: several heartbeat intervals (1 s by default); an older
# heartbeat means the worker is gone or hung, and then its gauges are not read for queues.
ENDED_WINDOW_S = 10.0


class EndedWork:
    """Requests and prompt tokens this router saw end at each worker address, kept for
    ``window_s`` seconds of ``clock`` (wall time: heartbeats are stamped with it, so a worker's
    clock running behind the router's makes its heartbeats look older than they are)."""

    def __init__(self, window_s: float = ENDED_WINDOW_S, clock: Callable[[], float] = time.time):
        self._window_s, self._clock = window_s, clock
        self._events: dict[str, deque[tuple[float, int, int]]] = {}  # address -> (time, requests, tokens)

    def note(self, address: str, num_requests: int = 0, num_tokens: int = 0) -> None:
        """Records that ``num_requests`` requests / ``num_tokens`` prompt tokens ended now."""
        now_s = self._clock()
        events = self._events.setdefault(address, deque())
        events.append((now_s, num_requests, num_tokens))
        while events and events[0][0] < now_s - self._window_s:
            events.popleft()

    def since(self, address: str, since_s: float) -> tuple[int, int]:
        """(requests, prompt tokens) that ended at ``address`` after ``since_s``; none when
        ``since_s`` is 0 (a heartbeat of unknown time)."""
        num_requests = num_tokens = 0
        if since_s <= 0:
            return 0, 0
        for time_s, requests, tokens in reversed(self._events.get(address, ())):
            if time_s <= since_s:
                break
            num_requests, num_tokens = num_requests + requests, num_tokens + tokens
        return num_requests, num_tokens


class PlacementView:
    """Read-only access to a :class:`PlacementBook` (what policies and the Predictor get)."""

    __slots__ = ("_book",)

    def __init__(self, book: PlacementBook):
        self._book = book

    def in_flight(self, address: str) -> int:
        """This router's requests running at ``address`` now."""
        return self._book._in_flight.get(address)

    def ended_since(self, address: str, since_s: float) -> tuple[int, int]:
        """(requests, prompt tokens) this router saw end at ``address`` after wall time
        ``since_s`` (a heartbeat's ``heartbeat_time_s``): what that heartbeat over-counts."""
        return self._book._ended.since(address, since_s)

    def pending_tokens(self, address: str) -> int:
        """Prompt tokens this router placed at ``address`` that still wait for their first token."""
        return self._book._pending.total(address)

    def awaiting_decode(self, address: str) -> int:
        """Requests this router placed at decode worker ``address`` whose Decode stream has not
        opened yet (prefilling elsewhere)."""
        return self._book._awaiting_decode.total(address)

    def local_cached_blocks(self, address: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` this router recently sent to ``address``."""
        return self._book._local_cache.num_cached_blocks(address, block_hashes)

    def reads(self, book: PlacementBook) -> bool:
        """Whether this view shows ``book``."""
        return self._book is book


class PlacementBook:
    """The bookkeeping itself; see the module docstring. Its methods say what they mutate.

    Raises:
        ValueError: ``cache_capacity_blocks`` < 1.
    """

    def __init__(self, cache_capacity_blocks: int = 8192):
        self._in_flight = InFlightCounter()
        self._pending = PlacedAmounts()
        self._awaiting_decode = PlacedAmounts()
        self._local_cache = LocalPrefixCache(cache_capacity_blocks)
        self._ended = EndedWork()
        self.view = PlacementView(self)

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Counts one request in flight at ``address`` for the ``with`` block, and its end.
        Mutates: in flight, ended work."""
        try:
            with self._in_flight.track(address):
                yield
        finally:
            self._ended.note(address, num_requests=1)

    def add_pending(self, key: Hashable, address: str, num_tokens: int) -> None:
        """Queues ``num_tokens`` prompt tokens at ``address`` under ``key``. Mutates: pending."""
        self._pending.add(key, address, num_tokens)

    def remove_pending(self, key: Hashable) -> None:
        """Forgets ``key``'s pending tokens (no-op when unknown): they were prefilled, or
        never will be. Mutates: pending, ended work."""
        entry = self._pending.remove(key)
        if entry is not None:
            self._ended.note(entry[0], num_tokens=entry[1])

    def add_awaiting_decode(self, key: Hashable, address: str) -> None:
        """Counts ``key``'s request at decode worker ``address`` until its Decode stream opens.
        Mutates: awaiting decode."""
        self._awaiting_decode.add(key, address, 1)

    def remove_awaiting_decode(self, key: Hashable) -> None:
        """Forgets ``key``'s request awaiting decode (no-op when unknown): its Decode stream
        opened (then counted in flight) or the request ended. Mutates: awaiting decode."""
        self._awaiting_decode.remove(key)

    def record_sent(self, address: str, block_hashes: Sequence[int]) -> None:
        """Notes that ``block_hashes`` went to ``address``. Mutates: the local prefix view."""
        self._local_cache.record(address, block_hashes)
