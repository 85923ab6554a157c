"""Supervision of ``tandem up``'s processes, the way Kubernetes restarts a pod's container.

A prefill/decode worker, KV pool or private Redis process that exits while the cluster runs is
restarted with the same arguments and port (its log appended to) after a backoff:
``initial_backoff_s`` doubled for each restart of that service still inside the window, capped at
``max_backoff_s``. At most ``max_restarts`` restarts per service in any ``window_s`` seconds; the
next exit stops the cluster with an error naming the service and its log. A restarted Redis is
empty (it never persists): the workers re-register with their next heartbeat and each pool node
re-publishes its block index (kv_pool.index_mirror), while the routers keep their view.
A lone router is never restarted: without it no request can be served, so its exit stops the
cluster; one of several routers (``tandem up --num-routers N``) is restarted like a worker while
the others serve (clients retry on them, docs/failover.md). Any exit stops the cluster when
``max_restarts`` is 0 (``tandem up --no-restart``: fail fast, for CI).

The router rides out the gap (docs/failover.md): it marks the dead worker down, retries prefill
elsewhere or colocated, migrates decode streams, and takes the restarted worker back once it
heartbeats and answers health checks.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

CRITICAL_SERVICES = frozenset({"router"})


class ServiceExited(RuntimeError):
    """A service exited and the cluster must stop (critical, restarts off, or budget spent)."""


class ServiceStartError(RuntimeError):
    """A service exited, or did not become healthy in time, while the cluster was starting (the
    message names it, the cause its log gives and the log's path)."""


def log_cause(text: str) -> str:
    """The last error a service's log ``text`` gives, on one line: of its JSON lines (the
    services' log format) the last at level error or above, its message and the last line of its
    traceback (``exc``); else the last non-empty line. "" when there is none."""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
            exc = [x for x in str(entry.get("exc") or "").splitlines() if x.strip()]
            return str(entry.get("msg", "")) + (f": {exc[-1].strip()}" if exc else "")
    return lines[-1].strip()[:500] if lines else ""


class StartInterrupted(RuntimeError):
    """SIGINT or SIGTERM arrived while the cluster was starting: nothing more is started; the
    caller stops what already was."""

    def __init__(self, starting: str):
        super().__init__(f"start-up interrupted while starting {starting}; nothing more is started")


@dataclass(frozen=True)
class RestartPolicy:
    """How exited services are restarted. Raises ValueError on a negative or zero duration."""

    max_restarts: int = 5  # per service within window_s; 0: never restart (fail fast)
    window_s: float = 60.0
    initial_backoff_s: float = 0.5  # before a service's first restart in the window
    max_backoff_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("window_s", "initial_backoff_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


class RestartBudget:
    """The restarts of one service in the sliding window ``(now_s - window_s, now_s]``.

    Times are seconds on one monotonic clock.
    """

    def __init__(self, policy: RestartPolicy):
        self.policy = policy
        self._restart_times_s: deque[float] = deque()

    def num_recent(self, now_s: float) -> int:
        """Restarts inside the window ending at ``now_s``. Mutates: forgets older ones."""
        while self._restart_times_s and self._restart_times_s[0] <= now_s - self.policy.window_s:
            self._restart_times_s.popleft()
        return len(self._restart_times_s)

    def can_restart(self, now_s: float) -> bool:
        return self.num_recent(now_s) < self.policy.max_restarts

    def backoff_s(self, now_s: float) -> float:
        """Wait before the next restart: initial_backoff_s * 2**num_recent, at most max_backoff_s."""
        p = self.policy
        return min(p.max_backoff_s, p.initial_backoff_s * 2 ** self.num_recent(now_s))

    def record(self, now_s: float) -> None:
        """Counts a restart made at ``now_s``."""
        self._restart_times_s.append(now_s)


class Supervised(Protocol):
    """What the supervisor needs of one service (launcher.local_cluster.Service, RayService)."""

    name: str

    @property
    def log_location(self) -> str: ...  # where its log is, for messages

    def exit_code(self) -> int | None: ...  # None while it runs

    def ready(self) -> bool: ...

    def restart(self, note: str) -> None: ...  # same argv and port; ``note`` appended to its log


class Supervisor:
    """Decides, on each :meth:`poll`, what to do about services that exited."""

    def __init__(self, policy: RestartPolicy, clock: Callable[[], float] = time.monotonic,
                 critical: frozenset[str] = CRITICAL_SERVICES):
        """``critical``: names of services whose exit stops the cluster (a lone router)."""
        self.policy, self.clock, self.critical = policy, clock, critical
        self._budgets: dict[str, RestartBudget] = {}
        self._due_s: dict[str, float] = {}  # exited services -> when to restart them
        self._starting: set[str] = set()  # restarted, not healthy yet

    def poll(self, services: Iterable[Supervised]) -> list[str]:
        """One pass: restarts the services whose backoff is over, notices new exits and
        restarted services that became healthy. Returns one line per thing that happened.

        Raises:
            ServiceExited: a critical service (a lone router) exited, restarts are off, or a service spent its
                restart budget; the message names it, its exit code and its log.
        """
        now_s, events = self.clock(), []
        for service in services:
            name = service.name
            if name in self._due_s:
                if now_s >= self._due_s[name]:
                    events.append(self._restart(service, now_s))
                continue
            code = service.exit_code()
            if code is None:
                if name in self._starting and service.ready():
                    self._starting.discard(name)
                    events.append(f"{name} is healthy again")
                continue
            self._starting.discard(name)
            events.append(self._exited(service, code, now_s))
        return events

    def _exited(self, service: Supervised, code: int, now_s: float) -> str:
        name, policy = service.name, self.policy
        where = f"see {service.log_location}"
        if name in self.critical:
            raise ServiceExited(f"{name} exited ({code}); the cluster cannot run without it; {where}")
        if policy.max_restarts == 0:
            raise ServiceExited(f"{name} exited ({code}); restarts are off (--no-restart); {where}")
        budget = self._budgets.setdefault(name, RestartBudget(policy))
        if not budget.can_restart(now_s):
            raise ServiceExited(f"{name} exited ({code}) after {policy.max_restarts} restarts in the last "
                                f"{policy.window_s:g} s; stopping the cluster; {where}")
        backoff_s = budget.backoff_s(now_s)
        self._due_s[name] = now_s + backoff_s
        return (f"{name} exited ({code}); restarting it in {backoff_s:g} s (restart "
                f"{budget.num_recent(now_s) + 1} of at most {policy.max_restarts} in {policy.window_s:g} s); {where}")

    def _restart(self, service: Supervised, now_s: float) -> str:
        name = service.name
        del self._due_s[name]
        budget = self._budgets[name]
        budget.record(now_s)
        service.restart(f"--- tandem up: restarting {name} (restart {budget.num_recent(now_s)} in "
                        f"{self.policy.window_s:g} s) ---\n")
        self._starting.add(name)
        return f"{name} restarted"
