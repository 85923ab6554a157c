"""`tandem up --autoscale`: the autoscaler on the launcher's own thread over a LocalCluster.

Synchronous on purpose: local workers must be started from the thread that started the cluster
(their PR_SET_PDEATHSIG is tied to it; launcher.local_cluster.Service.restart).
"""

from __future__ import annotations

import time

import redis

from autoscaler.actuators import LocalActuator
from autoscaler.policy import ROLES, Autoscaler, AutoscaleConfig, role_pressure
from core.registry import KEY_PREFIX, WorkerInfo
from core.worker_load import WorkerLoad


def read_loads(redis_url: str) -> dict[str, list[WorkerLoad]]:
    """role -> the heartbeat loads of its registered workers (blocking Redis reads); an entry
    that does not parse (another release's load version) raises ValueError."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        loads: dict[str, list[WorkerLoad]] = {role: [] for role in ROLES}
        for role in ROLES:
            keys = list(client.scan_iter(match=f"{KEY_PREFIX}:{role}:*", count=100))
            for value in client.mget(keys) if keys else []:
                if value is not None:
                    loads[role].append(WorkerInfo.from_json(value).load)
        return loads
    finally:
        client.close()


class LocalAutoscaler:
    """One :meth:`step` per ``interval_s`` from the launcher's loop."""

    def __init__(self, cluster, config: AutoscaleConfig, interval_s: float = 2.0):
        self.cluster, self.interval_s = cluster, interval_s
        self.actuator = LocalActuator(cluster)
        self.autoscaler = Autoscaler(config)
        self._next_s = 0.0
        self.history: list[tuple[float, dict[str, float], dict[str, int]]] = []  # (time, pressures, replicas)

    def read_live(self, role: str) -> list[WorkerLoad]:
        """The heartbeats of ``role``'s registered workers."""
        return read_loads(self.cluster.redis_url)[role]

    def step(self, now_s: float | None = None) -> list[str]:
        """Evaluates if due; starts or drains workers; returns one line per change."""
        now_s = time.monotonic() if now_s is None else now_s
        if now_s < self._next_s:
            return []
        self._next_s = now_s + self.interval_s
        loads = read_loads(self.cluster.redis_url)
        roles = self.cluster.config.worker_roles
        current = {role: self.actuator.replicas(role) if role in roles else 0 for role in ROLES}
        wanted = self.autoscaler.evaluate(now_s, loads, current)
        pressures = {role: round(role_pressure(role, loads[role], self.autoscaler.config), 3) for role in roles}
        self.history.append((round(now_s, 1), pressures, wanted))
        events = []
        for role in roles:
            if wanted[role] != current[role]:
                pressure = role_pressure(role, loads[role], self.autoscaler.config)
                self.actuator.scale(role, wanted[role])
                events.append(f"autoscale: {role} workers {current[role]} -> {wanted[role]} (pressure {pressure:.2f})")
        return events
