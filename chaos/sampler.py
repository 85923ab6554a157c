"""The cluster's gauges over time while a scenario runs (the soak's evidence that nothing grows).

Every ``every_s`` seconds a :class:`Sample` records, per service, its resident memory (RSS) and
the stats its GetStats RPC answers (pool: used bytes, blocks stored / leased / scoped, leases;
workers: KV blocks used, requests running / waiting), plus the driver's counts of requests ended
by status and tokens received. :func:`summary` reduces a run to first / last / max per series and
the RSS slope over the run's second half (the first half is warm-up: allocator arenas, caches,
compiled kernels), and :func:`plot` draws them.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from chaos.driver import Driver
from chaos.probe import ClusterProbe

MIB = 1024 * 1024


@dataclass
class Sample:
    t_s: float  # seconds after the run started
    rss_bytes: dict[str, int]  # by service
    gauges: dict[str, int]  # "service.field" -> value (GetStats fields)
    ended: dict[str, int] = field(default_factory=dict)  # requests ended so far, by status
    num_tokens: int = 0  # tokens received so far


class Sampler:
    """Takes a :class:`Sample` every ``every_s`` seconds until cancelled (blocking reads run in a
    thread, so the driver's event loop is not held)."""

    def __init__(self, probe: ClusterProbe, driver: Driver, every_s: float):
        self.probe, self.driver, self.every_s = probe, driver, every_s
        self.samples: list[Sample] = []

    async def run(self) -> None:
        while True:
            self.samples.append(await asyncio.to_thread(self.take))
            await asyncio.sleep(self.every_s)

    def take(self) -> Sample:
        ended: dict[str, int] = {}
        for outcome in list(self.driver.outcomes):
            if outcome.end_s > 0:
                ended[outcome.status] = ended.get(outcome.status, 0) + 1
        return Sample(round(self.driver.progress.now_s(), 1), self.probe.rss_by_service(), self.probe.gauges(),
                      ended, self.driver.progress.num_tokens)


def _slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (t_s, value) points, per hour; None with fewer than 3 points."""
    if len(points) < 3:
        return None
    ts, vs = [t for t, _ in points], [v for _, v in points]
    t_mean, v_mean = statistics.fmean(ts), statistics.fmean(vs)
    var = sum((t - t_mean) ** 2 for t in ts)
    if var == 0:
        return None
    return sum((t - t_mean) * (v - v_mean) for t, v in zip(ts, vs)) / var * 3600


def summary(samples: list[Sample]) -> dict[str, dict[str, float | None]]:
    """Per series (``rss_mib.<service>``, ``<service>.<gauge>``): first, last, max, and for RSS
    the slope in MiB per hour over the second half of the run."""
    out: dict[str, dict[str, float | None]] = {}
    if not samples:
        return out
    half_s = samples[-1].t_s / 2
    for service in samples[0].rss_bytes:
        series = [(s.t_s, s.rss_bytes.get(service, 0) / MIB) for s in samples]
        values = [v for _, v in series]
        out[f"rss_mib.{service}"] = {"first": round(values[0], 1), "last": round(values[-1], 1),
                                     "max": round(max(values), 1),
                                     "slope_mib_per_h": _round(_slope_per_hour([p for p in series if p[0] >= half_s]))}
    for name in samples[0].gauges:
        values = [s.gauges.get(name, 0) for s in samples]
        out[name] = {"first": values[0], "last": values[-1], "max": max(values)}
    return out


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def plot(samples: list[Sample], path: Path, title: str) -> None:
    """RSS growth per service, pool bytes used, worker KV blocks used and requests completed per minute,
    against time, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not samples:
        return
    minutes = [s.t_s / 60 for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    for service, first in samples[0].rss_bytes.items():
        axes[0].plot(minutes, [(s.rss_bytes.get(service, 0) - first) / MIB for s in samples],
                     label=f"{service} ({first / MIB:.0f} MiB at start)")
    axes[0].set_ylabel("RSS growth (MiB)")
    axes[0].legend(fontsize=7, ncol=3)
    axes[1].plot(minutes, [s.gauges.get("kv_pool.used_bytes", 0) / MIB for s in samples], label="pool used")
    axes[1].plot(minutes, [s.gauges.get("kv_pool.num_leases", 0) for s in samples], label="pool leases")
    axes[1].set_ylabel("MiB / leases")
    axes[1].legend(fontsize=7)
    for name in samples[0].gauges:
        if name.endswith(".num_used_blocks"):
            axes[2].plot(minutes, [s.gauges.get(name, 0) for s in samples], label=name)
    axes[2].set_ylabel("KV blocks used")
    axes[2].legend(fontsize=7)
    done = [s.ended.get("completed", 0) for s in samples]
    rate = [0.0] + [(b - a) / max(1e-9, (t1 - t0)) for a, b, t0, t1 in zip(done, done[1:], minutes, minutes[1:])]
    axes[3].plot(minutes, rate, label="completed / min")
    errors = [sum(v for k, v in s.ended.items() if k != "completed") for s in samples]
    axes[3].plot(minutes, errors, label="not completed (cumulative)")
    axes[3].set_ylabel("requests")
    axes[3].set_xlabel("minutes")
    axes[3].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
