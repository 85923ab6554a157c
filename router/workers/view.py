"""The router's view of live workers, re-read from the Redis registry in the background.

A worker leaves the view at once when the router sees it fail (:meth:`WorkerView.mark_down`: a
broken RPC or stream), when its grpc.health.v1 check says NOT_SERVING or nothing listens at its
address (checked every ``health_interval_s``; a check that times out proves nothing), and by
itself when it stops heartbeating (its registry key expires after the heartbeat TTL). A
marked-down worker comes back only when it proves healthy again: a
heartbeat newer than the failure *and* a grpc.health.v1 probe answering SERVING; one that
disappears from the registry is forgotten (a restarted worker registers afresh) once its
heartbeat is older than the loss bound.

Hung workers: a worker whose heartbeat stops moving for its bound (its TTL + 2 s)
and that does not answer a health check with SERVING is **lost** (router.workers.loss): marked down, and the calls still waiting on it fail over.

When the registry may have lost entries without their workers leaving, the workers known before
stay in the view for ``WIPE_GRACE_S`` while they re-register (:meth:`WorkerView._registry_reset`):
every entry vanished at once, the read is the first good one after failed ones (Redis was down:
it comes back empty, or the keys expired meanwhile), or Redis answers with another ``run_id``
(it restarted between two reads). The workers re-register one heartbeat at a time, so the first
read after Redis returns typically lists only some of them: before this rule, the missing ones
left the view and requests got 503 ``no_worker`` for that half second (the campaign's "Redis
down 8 s" row). Otherwise a single worker gone from the registry (deregistered, expired) leaves
the view at once, though its calls still fail over only once it is lost. While Redis cannot be
read at all, the view is kept as long as the health sweeps keep confirming it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from core.registry import ROLES, WorkerInfo, WorkerRegistry
from router.workers.loss import LossWatch

log = logging.getLogger(__name__)



class Health(enum.Enum):
    """What one health check of a worker said."""

    SERVING = "serving"
    NOT_SERVING = "not_serving"  # it said so (draining), or nothing listens at its address
    UNKNOWN = "unknown"  # no answer in time: proves nothing either way


HealthProbe = Callable[[str], Awaitable[Health]]  # address -> its health
PROBED_ROLES = ("prefill", "decode")
# After a registry read that may have lost entries (Redis restarted or came back: see
# WorkerView._registry_reset), the workers known before stay in the view this long, or until
# lost, while they re-register.
WIPE_GRACE_S = 10.0


@dataclass
class _Down:
    reason: str
    heartbeat_time_s: float  # the worker's last heartbeat seen when it was marked down


class WorkerView:
    """Live workers by role, refreshed every ``interval_s``.

    When Redis cannot be read the last view is kept for ``stale_after_s`` (15 s: three Redis call
    timeouts, so a hung Redis does not outlast it) past the last read or health sweep that
    confirmed it, then dropped: better to answer 503 than to route to workers
    that may have died meanwhile.
    """

    def __init__(self, registry: WorkerRegistry, interval_s: float = 0.5, stale_after_s: float = 15.0,
                 probe: HealthProbe | None = None, health_interval_s: float = 2.0, loss: LossWatch | None = None):
        self.registry = registry
        self.loss = loss or LossWatch()
        self.interval_s = interval_s
        self.stale_after_s = stale_after_s
        self.probe = probe
        self.health_interval_s = health_interval_s
        self._checked_at_s = 0.0  # time.monotonic() of the last health sweep
        self._workers: dict[str, list[WorkerInfo]] = {role: [] for role in ROLES}
        self._refreshed_at_s = 0.0  # time.monotonic() of the last successful refresh
        self._wiped_at_s = float("-inf")  # time.monotonic() when the registry last read reset
        self._read_failed = False  # the last registry read failed
        self._server_id = ""  # the Redis run_id of the last good read ("" unknown)
        self._down: dict[str, _Down] = {}  # by address
        # Workers missing from a readable registry that answered SERVING: kept in the view
        # (_keep_missing), by address
        self._kept_missing: set[str] = set()
        self._asked_missing: set[str] = set()  # missing workers probed once already (not asked again while missing)
        self._task: asyncio.Task | None = None

    def workers(self, role: str) -> list[WorkerInfo]:
        """Live workers of ``role`` as of the last refresh, minus those marked down (empty when
        the last refresh is too old)."""
        if time.monotonic() - self._refreshed_at_s > self.stale_after_s:
            return []
        return [w for w in self._workers[role] if w.address not in self._down]

    def mark_down(self, address: str, reason: str) -> None:
        """Stops routing to ``address`` at once (mutates the down set; logs the first marking)."""
        if address in self._down:
            return
        last_beat = max((w.heartbeat_time_s for ws in self._workers.values() for w in ws if w.address == address),
                        default=0.0)
        self._down[address] = _Down(reason, last_beat)
        log.warning("worker %s marked down: %s", address, reason)

    async def refresh(self) -> None:
        """Re-reads every role from Redis; loses workers whose heartbeat stopped (router.workers.loss);
        every ``health_interval_s`` marks down the workers whose health check fails; brings back
        marked-down workers that heartbeat again and answer SERVING (mutates the down set).
        Raises redis errors (the loop logs them) after a health sweep of the last view."""
        try:
            fresh = {role: await self.registry.list_workers(role) for role in ROLES}
            server_id = await self.registry.server_id()
        except Exception:
            self._read_failed = True
            self.loss.unreadable()
            if await self._sweep_due():  # probes confirmed the last view
                self._refreshed_at_s = time.monotonic()
            raise
        self.loss.readable()
        for info in self.loss.observe([w for ws in fresh.values() for w in ws]):
            await self._lose_unless_serving(info)
        known = {role: self.loss.known(role) for role in ROLES}
        by_address = {w.address: w for ws in known.values() for w in ws}
        if self._registry_reset(fresh, server_id) and any(self._workers.values()):
            self._wiped_at_s = time.monotonic()
        wiped = time.monotonic() - self._wiped_at_s < WIPE_GRACE_S
        listed = {w.address for ws in fresh.values() for w in ws}
        down_before = set(self._down)  # a worker down when it goes missing is never kept
        # A kept worker marked down stays down (not forgotten) until its heartbeats return
        present = by_address.keys() if wiped else listed | (self._kept_missing & by_address.keys())
        for address in [a for a in self._down if a not in present]:
            log.info("worker %s left the registry; forgotten", address)
            del self._down[address]
        for address, down in list(self._down.items()):
            info = by_address.get(address)  # None: lost, its stale entry still listed
            if info is not None and info.heartbeat_time_s > down.heartbeat_time_s and await self._probe(address) is Health.SERVING:
                del self._down[address]
                log.info("worker %s is healthy again (was down: %s)", address, down.reason)
        if wiped:
            self._workers = known  # the workers re-register with their next heartbeats
        else:  # a worker gone from the registry leaves the view at once, unless it still serves
            kept = await self._keep_missing([w for ws in known.values() for w in ws if w.address not in listed],
                                            down_before)
            self._workers = {role: sorted([w for w in fresh[role] if w.address in by_address]
                                          + [w for w in known[role] if w.address in kept], key=lambda w: w.worker_id)
                             for role in ROLES}
        await self._sweep_due()
        self._refreshed_at_s = time.monotonic()

    def _registry_reset(self, fresh: dict[str, list[WorkerInfo]], server_id: str) -> bool:
        """Whether this good read may miss entries whose workers never left: every entry gone
        at once, the first good read after failed ones, or another Redis server (``run_id``)
        than the last good read. Mutates: the last read's failure flag and server id."""
        restarted = bool(self._server_id and server_id and server_id != self._server_id)
        reason = ("another Redis run_id" if restarted else "first good read after failed ones" if self._read_failed
                  else "every entry gone" if not any(fresh.values()) else "")
        self._read_failed, self._server_id = False, server_id or self._server_id
        if reason and any(self._workers.values()):
            log.info("the registry may have lost entries (%s); keeping the known workers %g s while they re-register",
                     reason, WIPE_GRACE_S)
        return bool(reason)

    async def _keep_missing(self, missing: list[WorkerInfo], down: set[str]) -> set[str]:
        """Which of ``missing`` (known, not lost, gone from a readable registry) stay in the view:
        a worker of a probed role that answered SERVING when it first went missing (asked once
        per absence; never one in ``down``, marked down before this read; one marked down since
        stays kept, and down, until its heartbeats return).
        Needs a health probe (without one: none). Mutates: the kept and asked sets (a worker
        listed again or lost leaves them)."""
        candidates = {w.address for w in missing if w.role in PROBED_ROLES}
        self._kept_missing &= candidates
        self._asked_missing &= candidates
        if self.probe is None:
            return set()
        self._asked_missing |= candidates & (down | self._down.keys())  # not kept in this absence
        new = sorted(candidates - self._asked_missing)
        self._asked_missing.update(new)
        for address, health in zip(new, await asyncio.gather(*(self._probe(a) for a in new))):
            if health is Health.SERVING:
                self._kept_missing.add(address)
                log.warning("worker %s left the registry (its heartbeats do not reach Redis) but answers SERVING; "
                            "kept with its last load", address)
        return set(self._kept_missing)

    async def _lose_unless_serving(self, info: WorkerInfo) -> None:
        """A worker whose heartbeat stood still past its bound: lost, unless it answers a health
        check with SERVING (then its heartbeats only ran late). Without a probe: lost."""
        if self.probe is not None and await self._probe(info.address) is Health.SERVING:
            self.loss.spare(info.address)
            log.info("worker %s heartbeat %g s late but it answers SERVING; kept", info.address,
                     self.loss.bound_s(info))
            return
        self.loss.lose(info.address)
        log.warning("worker %s lost: no heartbeat for %g s", info.address, self.loss.bound_s(info))

    async def _sweep_due(self) -> int:
        """Health-checks the view's prefill and decode workers if ``health_interval_s`` passed.
        Returns how many answered SERVING (0 when no sweep was due)."""
        if self.probe is None or time.monotonic() - self._checked_at_s < self.health_interval_s:
            return 0
        self._checked_at_s = time.monotonic()
        addresses = [w.address for role in PROBED_ROLES for w in self._workers[role] if w.address not in self._down]
        return await self._check_health(addresses) > 0

    async def _check_health(self, addresses: list[str]) -> int:
        """Probes ``addresses`` concurrently; marks down those that are NOT_SERVING. Returns how
        many answered SERVING."""
        results = await asyncio.gather(*(self._probe(a) for a in addresses))
        for address, health in zip(addresses, results):
            if health is Health.NOT_SERVING:
                self.mark_down(address, "health check: not serving")
        return sum(health is Health.SERVING for health in results)

    async def _probe(self, address: str) -> Health:
        if self.probe is None:
            return Health.SERVING
        try:
            return await self.probe(address)
        except Exception:  # a probe that cannot run proves nothing
            log.debug("health probe of %s failed", address, exc_info=True)
            return Health.UNKNOWN

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
