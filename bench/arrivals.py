"""Arrival processes: when each request is sent.

``trace``: the trace's own timestamps times ``time_scale`` (0.5 replays twice as fast);
``poisson``: exponential gaps at ``rate_per_s`` from a seeded generator; ``concurrency``: no
schedule, a new request as soon as one of ``concurrency`` slots frees.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

ARRIVAL_MODES = ("trace", "poisson", "concurrency")


@dataclass(frozen=True)
class ArrivalConfig:
    mode: str = "concurrency"
    time_scale: float = 1.0  # trace: send time = trace time x time_scale
    rate_per_s: float = 1.0  # poisson
    concurrency: int = 8  # concurrency; also the in-flight cap of the others when max_in_flight is 0
    max_in_flight: int = 0  # trace/poisson: 0 = unbounded (open loop)
    duration_s: float = 0.0  # no request is sent after this; 0: no cap
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in ARRIVAL_MODES:
            raise ValueError(f"unknown arrival mode {self.mode!r}; expected one of {ARRIVAL_MODES}")
        if self.time_scale <= 0 or self.rate_per_s <= 0 or self.concurrency < 1:
            raise ValueError(f"time_scale, rate_per_s must be > 0 and concurrency >= 1: "
                             f"{self.time_scale}, {self.rate_per_s}, {self.concurrency}")
        if self.duration_s < 0 or self.max_in_flight < 0:
            raise ValueError(f"duration_s and max_in_flight must be >= 0: {self.duration_s}, {self.max_in_flight}")


def trace_times_s(arrivals_s: list[float | None], time_scale: float) -> list[float]:
    """Send offsets from trace arrival times (shifted so the first is 0). Raises ValueError if any is None."""
    if any(a is None for a in arrivals_s):
        raise ValueError("trace arrivals need a trace workload (prompt sets have no timestamps)")
    if not arrivals_s:
        return []
    t0 = min(arrivals_s)
    return [(a - t0) * time_scale for a in arrivals_s]


def poisson_times_s(num_requests: int, rate_per_s: float, seed: int) -> list[float]:
    """Cumulative exponential gaps with mean 1/rate_per_s; the first request goes at its first gap."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, num_requests)
    return np.cumsum(gaps).tolist()


def send_times_s(config: ArrivalConfig, arrivals_s: list[float | None]) -> list[float] | None:
    """Send offsets (s from the start) for requests with these trace arrival times, cut at
    ``duration_s``; None for closed-loop concurrency (the runner paces itself)."""
    if config.mode == "concurrency":
        return None
    if config.mode == "trace":
        times = trace_times_s(arrivals_s, config.time_scale)
    else:
        times = poisson_times_s(len(arrivals_s), config.rate_per_s, config.seed)
    if config.duration_s:
        # a prefix, so times[i] still belongs to request i (traces are in time order)
        times = list(itertools.takewhile(lambda t: t <= config.duration_s, times))
    return times
