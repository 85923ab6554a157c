"""Graceful shutdown of the router's requests: refuse new ones, let in-flight ones run on for a
grace period, then end every one still running with an explicit error, never a cut connection.

    begin()             new requests raise RouterError(SHUTTING_DOWN): HTTP 503, gRPC UNAVAILABLE
    wait_idle(grace_s)  in-flight requests run on (at most grace_s seconds)
    abort()             every request still running raises RouterError(SHUTTING_DOWN) at its next
                        event; the front-ends turn it into their last event (SSE: an abort chunk,
                        an ``{"error": ...}`` event and ``[DONE]``; gRPC: status UNAVAILABLE)
    wait_idle(flush_s)  those errors have reached the front-ends; now the servers may stop

Only then are uvicorn and the gRPC server stopped (router.server), so their own shutdown finds no
request left to cancel.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from router.errors import ErrorKind, RouterError

T = TypeVar("T")
SHUTTING_DOWN_MESSAGE = "router shutting down"


def shutting_down_error() -> RouterError:
    return RouterError(SHUTTING_DOWN_MESSAGE, ErrorKind.SHUTTING_DOWN)


class Shutdown:
    """Counts running requests and ends them on ``abort``. One per router, one event loop."""

    def __init__(self) -> None:
        self.stopping = False  # begin() was called: no new request
        self._aborted: asyncio.Future[None] | None = None  # created in the loop on first use
        self._num_running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_running(self) -> int:
        """Requests that entered and have not left."""
        return self._num_running

    def begin(self) -> None:
        """From now on ``enter`` refuses new requests. Mutates: ``stopping``."""
        self.stopping = True

    def abort(self) -> None:
        """Refuses new requests and ends the running ones: each ``guard`` raises at once."""
        self.begin()
        aborted = self._aborted_future()
        if not aborted.done():
            aborted.set_result(None)

    def enter(self) -> None:
        """Counts one more running request; the caller calls ``leave`` once it ends.

        Raises:
            RouterError: SHUTTING_DOWN, when ``begin`` was called (nothing is counted).
        """
        if self.stopping:
            raise shutting_down_error()
        self._num_running += 1
        self._idle.clear()

    def leave(self) -> None:
        """One running request ended (it ``enter``-ed)."""
        self._num_running -= 1
        if self._num_running == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Waits until no request is running, at most ``timeout_s`` seconds; True when none is."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def guard(self, step: Awaitable[T]) -> T:
        """Awaits ``step`` unless ``abort`` comes first; then cancels it (its ``finally`` blocks
        run before this returns) and raises.

        Raises:
            RouterError: SHUTTING_DOWN, when aborted before ``step`` finished.
            Whatever ``step`` raises.
        """
        aborted = self._aborted_future()
        if aborted.done():
            if asyncio.iscoroutine(step):
                step.close()  # never started: nothing to clean up, no "never awaited" warning
            raise shutting_down_error()
        task = asyncio.ensure_future(step)
        try:
            await asyncio.wait({task, aborted}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the caller is cancelled (the client left): the step cleans up first
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled() and aborted.done():
            raise shutting_down_error()
        return task.result()

    def _aborted_future(self) -> asyncio.Future[None]:
        if self._aborted is None:
            self._aborted = asyncio.get_running_loop().create_future()
        return self._aborted
