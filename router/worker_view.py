"""The router's view of live workers, re-read from the Redis registry in the background."""

from __future__ import annotations

import asyncio
import logging
import time

from core.registry import ROLES, WorkerInfo, WorkerRegistry

log = logging.getLogger(__name__)


class WorkerView:
    """Live workers by role, refreshed every ``interval_s``.

    When Redis cannot be read the last view is kept for ``stale_after_s``, then dropped: better
    to answer 503 than to route to workers that may have died meanwhile.
    """

    def __init__(self, registry: WorkerRegistry, interval_s: float = 0.5, stale_after_s: float = 5.0):
        self.registry = registry
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self._workers: dict[str, list[WorkerInfo]] = {role: [] for role in ROLES}
        self._refreshed_at_s = 0.0  # time.monotonic() of the last successful refresh
        self._task: asyncio.Task | None = None

    def workers(self, role: str) -> list[WorkerInfo]:
        """Live workers of ``role`` as of the last refresh (empty when that is too old)."""
        if time.monotonic() - self._refreshed_at_s > self.stale_after_s:
            return []
        return list(self._workers[role])

    async def refresh(self) -> None:
        """Re-reads every role from Redis. Raises redis errors (the loop logs them)."""
        fresh = {role: await self.registry.list_workers(role) for role in ROLES}
        self._workers = fresh
        self._refreshed_at_s = time.monotonic()

    async def start(self) -> None:
        """Reads the registry once (errors logged, not raised), then keeps refreshing."""
        await self._refresh_logged()
        self._task = asyncio.create_task(self._run(), name="worker-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._refresh_logged()

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:  # Redis down: keep the last view until it goes stale
            log.warning("cannot read the worker registry", exc_info=True)
