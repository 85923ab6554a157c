"""When to add or remove a prefill or a decode worker: pressure against the SLOs, with hysteresis.

Each role's **pressure** is read from its workers' heartbeats (``WorkerInfo.load``, a
``core.worker_load.WorkerLoad``, its fields); 1.0 means "at the SLO":

- prefill: the predicted TTFT of the queue, ``CostModel.prefill_s`` of the prompt tokens waiting
  and in the running pass (``num_waiting_tokens + num_batched_tokens``) on the worker's own fitted
  cost model, over the TTFT SLO; the mean over workers (the router spreads the backlog);
- decode: the largest of the measured step time (``recent_step_time_s``, the TBT) over the TBT
  SLO, the KV blocks in use over ``kv_usage_high``, the batch slots in use over
  ``kv_usage_high``, and the predicted TTFT of the prompt tokens it still has to compute
  (colocated prefill; disaggregated requests bring their KV) over the TTFT SLO; the mean over
  workers. (A request merely waiting for the next step is not pressure: a snapshot often catches
  one; waiting for blocks or slots shows as KV or slot usage.)

A role scales **up** by one worker after ``up_evaluations`` consecutive evaluations above
``scale_up_pressure``, **down** by one after ``down_evaluations`` consecutive evaluations in which
the same load on one worker fewer (``pressure * n / (n - 1)``) would stay below
``scale_down_pressure``; never outside its bounds, and not within ``cooldown_s`` of its last
change (the new worker's load must show first). One worker at a time, so a scale-down drains
one worker while the others take the traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.worker_load import WorkerLoad

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class AutoscaleConfig:
    """Raises ValueError on impossible bounds or thresholds, quoting them."""

    ttft_slo_s: float = 2.0
    tbt_slo_s: float = 0.2
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    scale_up_pressure: float = 1.0
    scale_down_pressure: float = 0.5
    up_evaluations: int = 2
    down_evaluations: int = 5
    cooldown_s: float = 30.0
    kv_usage_high: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.tbt_slo_s <= 0:
            raise ValueError(f"SLOs must be > 0 s, got ttft {self.ttft_slo_s}, tbt {self.tbt_slo_s}")
        for role in ROLES:
            low, high = self.bounds(role)
            if not 0 <= low <= high:
                raise ValueError(f"{role} bounds must satisfy 0 <= min <= max, got {low}, {high}")
        if self.min_decode < 1:
            raise ValueError(f"min_decode must be >= 1, got {self.min_decode}")
        if not 0 < self.scale_down_pressure < self.scale_up_pressure:
            raise ValueError(f"need 0 < scale_down_pressure < scale_up_pressure, got "
                             f"{self.scale_down_pressure}, {self.scale_up_pressure}")
        if self.up_evaluations < 1 or self.down_evaluations < 1 or self.cooldown_s < 0:
            raise ValueError(f"evaluations must be >= 1 and cooldown_s >= 0, got {self.up_evaluations}, "
                             f"{self.down_evaluations}, {self.cooldown_s}")
        if not 0 < self.kv_usage_high <= 1:
            raise ValueError(f"kv_usage_high must be in (0, 1], got {self.kv_usage_high}")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)


def prefill_pressure(load: WorkerLoad, config: AutoscaleConfig) -> float:
    """One prefill worker's queue, as predicted TTFT over the TTFT SLO (0 without a fitted cost
    model)."""
    cost = load.fitted_cost_model
    if cost is None:
        return 0.0
    return cost.prefill_s(load.num_waiting_tokens + load.num_batched_tokens) / config.ttft_slo_s


def decode_pressure(load: WorkerLoad, config: AutoscaleConfig) -> float:
    """One decode worker's: step time over the TBT SLO (while it runs requests), KV blocks and
    batch slots in use over ``kv_usage_high``, its prompt backlog's predicted TTFT over the TTFT SLO.

    The step time is the mean of the worker's last passes, which stays as it was when the worker
    goes idle: an idle worker's last passes say nothing about its load now, so they count only
    while requests run (else a load that ended above half the SLO would never scale down)."""
    step_s = load.recent_step_time_s if load.num_requests_running else 0.0
    pressures = [step_s / config.tbt_slo_s, prefill_pressure(load, config)]
    if load.num_total_blocks:
        pressures.append(load.num_used_blocks / load.num_total_blocks / config.kv_usage_high)
    if load.max_num_seqs:
        pressures.append(load.num_requests_running / load.max_num_seqs / config.kv_usage_high)
    return max(pressures)


def role_pressure(role: str, loads: Sequence[WorkerLoad], config: AutoscaleConfig) -> float:
    """The mean pressure of ``role``'s workers (0 with none)."""
    one = prefill_pressure if role == "prefill" else decode_pressure
    return sum(one(load, config) for load in loads) / len(loads) if loads else 0.0


@dataclass
class _Streak:
    up: int = 0
    down: int = 0
    changed_at_s: float = float("-inf")


@dataclass
class Autoscaler:
    """The scaling decisions; :meth:`evaluate` once per interval. Mutates only its own streaks."""

    config: AutoscaleConfig
    _streaks: dict[str, _Streak] = field(default_factory=lambda: {role: _Streak() for role in ROLES})

    def evaluate(self, now_s: float, loads: dict[str, Sequence[WorkerLoad]],
                 replicas: dict[str, int]) -> dict[str, int]:
        """The replicas each role should have: ``replicas[role]`` or one more or fewer.

        ``loads[role]``: the heartbeats of that role's live workers; ``replicas[role]``: the
        workers asked for (a starting worker counts before it heartbeats). A role whose maximum is
        0 (colocated) stays at 0.
        """
        return {role: self._role(role, now_s, loads.get(role, ()), replicas.get(role, 0)) for role in ROLES}

    def _role(self, role: str, now_s: float, loads: Sequence[WorkerLoad], current: int) -> int:
        low, high = self.config.bounds(role)
        if current < low or current > high:
            return min(high, max(low, current))  # back within bounds at once
        streak, c = self._streaks[role], self.config
        pressure = role_pressure(role, loads, c)
        spread = pressure * current / (current - 1) if current > 1 else float("inf")
        streak.up = streak.up + 1 if pressure > c.scale_up_pressure else 0
        streak.down = streak.down + 1 if spread < c.scale_down_pressure else 0
        if now_s - streak.changed_at_s < c.cooldown_s or len(loads) < current:  # still settling
            return current
        if streak.up >= c.up_evaluations and current < high:
            return self._changed(streak, now_s, current + 1)
        if streak.down >= c.down_evaluations and current > low:
            return self._changed(streak, now_s, current - 1)
        return current

    @staticmethod
    def _changed(streak: _Streak, now_s: float, replicas: int) -> int:
        streak.up = streak.down = 0
        streak.changed_at_s = now_s
        return replicas
