"""The autoscaling loop: read heartbeats, decide (autoscaler.policy), act (autoscaler.actuators)."""

from __future__ import annotations

import asyncio
import logging
import time

from autoscaler.actuators import Actuator
from autoscaler.policy import ROLES, Autoscaler, AutoscaleConfig, role_pressure
from core.registry import WorkerRegistry

log = logging.getLogger(__name__)


class AutoscaleLoop:
    """Evaluates every ``interval_s``; ``step`` is one evaluation (tests call it directly)."""

    def __init__(self, registry: WorkerRegistry, actuator: Actuator, config: AutoscaleConfig, interval_s: float = 2.0):
        self.registry, self.actuator, self.interval_s = registry, actuator, interval_s
        self.autoscaler = Autoscaler(config)
        self.history: list[dict[str, int]] = []  # replicas after each evaluation

    async def step(self) -> dict[str, int]:
        """Reads every role's heartbeats, applies the decision; returns the replicas asked for.
        Blocking actuators run in a thread (a local worker start waits for its health)."""
        loads = {role: [w.load for w in await self.registry.list_workers(role)] for role in ROLES}
        current = {role: self.actuator.replicas(role) for role in ROLES}
        wanted = self.autoscaler.evaluate(time.monotonic(), loads, current)
        for role in ROLES:
            if wanted[role] != current[role]:
                log.info("scaling %s %d -> %d (pressure %.2f)", role, current[role], wanted[role],
                         role_pressure(role, loads[role], self.autoscaler.config))
                await asyncio.to_thread(self.actuator.scale, role, wanted[role])
        self.history.append(wanted)
        return wanted

    async def run(self) -> None:
        """Evaluates until cancelled; an evaluation that fails (Redis, the API server) is logged
        and retried at the next interval."""
        while True:
            try:
                await self.step()
            except Exception:
                log.warning("autoscaling evaluation failed", exc_info=True)
            await asyncio.sleep(self.interval_s)
