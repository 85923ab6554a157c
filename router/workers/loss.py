"""Noticing a worker that hangs, and failing over the calls that wait on it.

A hung worker (SIGSTOP, a wedged event loop) keeps its TCP connections open: its RPCs neither
answer nor fail, so nothing in gRPC notices. What stops is its heartbeat. :class:`LossWatch`
follows each worker's ``heartbeat_time_s`` as the router reads it from the registry and declares
a worker **lost** when no new heartbeat was seen for its bound, ``heartbeat_ttl_s`` +
``LOSS_MARGIN_S`` (``loss_after_s`` for a worker that does not say its TTL), in seconds of
registry time the router could read (a Redis outage or restart pauses the clock: the router
cannot tell who beat meanwhile). With the workers' defaults (a beat every 1 s, TTL 3 s) the
bound is 5 s. A worker that merely vanished from the registry (its key expired, or Redis restarted
with its data lost) stays known until then, so a Redis restart neither empties the view nor
migrates anything; a worker that re-registers within ``loss_after_s`` was never lost.

The router confirms a stale heartbeat with a health check before it loses the worker
(router.workers.view): a worker that still answers SERVING (alive, only starved of CPU so its
heartbeats ran late) is spared and its clock restarts. Losing a worker sets its
:meth:`LossWatch.lost_event`; :func:`unless_lost` and
:func:`stream_unless_lost` race a call against that event and raise
:class:`~router.errors.WorkerFailedError` when it fires, so the caller retries the prefill
or migrates the decode stream (router.generation) exactly as after a broken connection. The
abandoned call is cancelled: when the worker wakes (SIGCONT) it finds the RPC cancelled and
aborts the request, and the router never reads from it again, so nothing is served twice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from core.registry import WorkerInfo
from router.errors import WorkerFailedError

T = TypeVar("T")
DEFAULT_LOSS_AFTER_S = 5.0  # for a worker that does not say its heartbeat TTL
LOSS_MARGIN_S = 2.0  # past its registry key's TTL: two missed 1 s beats beyond the key's expiry


@dataclass
class _Seen:
    info: WorkerInfo  # the latest registry entry seen
    heartbeat_time_s: float  # its newest heartbeat_time_s (the worker's clock)
    heartbeat_seen_at_s: float  # clock() when that heartbeat_time_s was first seen


class LossWatch:
    """Per worker address: when its heartbeat last moved, and an event set when it is lost.

    Not thread-safe (the router's event loop is its only user). ``clock`` is monotonic seconds.
    """

    def __init__(self, loss_after_s: float = DEFAULT_LOSS_AFTER_S, clock: Callable[[], float] = time.monotonic):
        if not loss_after_s > 0:
            raise ValueError(f"loss_after_s must be > 0, got {loss_after_s}")
        self.loss_after_s, self.clock = loss_after_s, clock
        self._seen: dict[str, _Seen] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._lost: dict[str, float] = {}  # address -> the heartbeat_time_s it was lost with
        self._readable_since_s = clock()  # registry readable without a break since then

    def observe(self, listed: Iterable[WorkerInfo]) -> list[WorkerInfo]:
        """Takes one successful registry read. Returns the workers whose heartbeat stood still
        past their bound: the caller confirms each (:meth:`lose`) or spares it (:meth:`spare`).
        Mutates: what is known."""
        now_s = self.clock()
        for info in listed:
            if info.heartbeat_time_s <= self._lost.get(info.address, float("-inf")):
                continue  # still the entry it was lost with (a registry TTL above the bound)
            self._lost.pop(info.address, None)
            seen = self._seen.get(info.address)
            if seen is None or info.heartbeat_time_s > seen.heartbeat_time_s or info.worker_id != seen.info.worker_id:
                self._seen[info.address] = _Seen(info, info.heartbeat_time_s, now_s)
            else:
                seen.info = info
        return [s.info for s in self._seen.values()
                if now_s - max(s.heartbeat_seen_at_s, self._readable_since_s) > self.bound_s(s.info)]

    def spare(self, address: str) -> None:
        """A stale worker proved alive another way (it answered a health check): its clock
        restarts now. Mutates: what is known of it."""
        if address in self._seen:
            self._seen[address].heartbeat_seen_at_s = self.clock()

    def bound_s(self, info: WorkerInfo) -> float:
        """How long ``info``'s heartbeat may stand still before the worker is lost."""
        return info.heartbeat_ttl_s + LOSS_MARGIN_S if info.heartbeat_ttl_s > 0 else self.loss_after_s

    def unreadable(self) -> None:
        """The registry could not be read: the loss clock restarts when it can be again."""
        self._readable_since_s = float("inf")

    def readable(self) -> None:
        """Called before :meth:`observe` on each successful read (restarts the clock after a
        break). Mutates: the clock's origin."""
        if self._readable_since_s == float("inf"):
            self._readable_since_s = self.clock()

    def known(self, role: str) -> list[WorkerInfo]:
        """Every worker of ``role`` seen and not lost, listed now or not, sorted by worker_id."""
        return sorted((s.info for s in self._seen.values() if s.info.role == role), key=lambda w: w.worker_id)

    def lost_event(self, address: str) -> asyncio.Event:
        """Set once the worker at ``address`` is lost (a fresh event after that, for its successor)."""
        return self._events.setdefault(address, asyncio.Event())

    def lose(self, address: str) -> None:
        """Declares the worker at ``address`` lost: sets its event and forgets it (it comes back
        only with a newer heartbeat: it woke up, or a successor registered)."""
        self._lost[address] = self._seen.pop(address).heartbeat_time_s
        event = self._events.pop(address, None)
        if event is not None:
            event.set()


def _lost_error(address: str) -> Exception:
    return WorkerFailedError("worker stopped heartbeating (hung or unreachable); its call was abandoned", address)


async def unless_lost(call: Awaitable[T], lost: asyncio.Event, address: str) -> T:
    """Awaits ``call``; cancels it and raises WorkerFailedError if ``lost`` is set first."""
    task = asyncio.ensure_future(call)
    waiter = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _lost_error(address)
    finally:
        waiter.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def stream_unless_lost(stream: AsyncIterable[T], lost: asyncio.Event, address: str) -> AsyncIterator[T]:
    """Yields ``stream``'s items; raises WorkerFailedError once ``lost`` is set while waiting
    for the next one (the pending read is cancelled; the caller cancels the RPC). Nothing is
    left pending while suspended at a ``yield``, so a caller may stop iterating at any item."""
    items = aiter(stream)
    while True:
        step = asyncio.ensure_future(anext(items))
        waiter = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the caller was cancelled: so is the read
            step.cancel()
            raise
        finally:
            waiter.cancel()
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)
            raise _lost_error(address)
        try:
            item = step.result()
        except StopAsyncIteration:
            return
        yield item
