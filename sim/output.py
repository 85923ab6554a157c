"""A simulation's result in ``tandem bench``'s JSON and plots (bench.report, bench.plots)."""

from __future__ import annotations

from pathlib import Path

from bench import plots, report
from bench.metrics import SLO, summarize
from bench.runner import RunResult
from sim.simulator import SimResult

MAX_TBT_SCATTER_POINTS = 200_000  # TBT-over-time plots of bigger runs are skipped (minutes of matplotlib)


def result_json(label: str, settings: dict, result: SimResult, slo: SLO) -> dict:
    """bench.report.run_json's layout plus a ``sim`` section: per-worker utilisation, pool and
    prefix-cache hit rates, events processed."""
    summary = summarize(result.records, result.duration_s, slo)
    data = report.run_json(label, settings, RunResult(result.records, result.duration_s), summary)
    data["sim"] = {"workers": result.workers, "pool_hit_rate": result.pool_hit_rate,
                   "prefix_cache_hit_rate": result.prefix_cache_hit_rate, "num_events": result.num_events,
                   "mean_utilisation": {role: _mean([w["utilisation"] for w in result.workers if w["role"] == role])
                                        for role in ("prefill", "decode")}}
    return data


def save(data: dict, out_dir: Path, plot: bool = True) -> list[Path]:
    """Writes ``sim.json`` and, with ``plot``, the CDF and TBT-over-time PNGs; returns the paths."""
    paths = [report.save_json(data, out_dir / "sim.json")]
    if plot:
        paths.append(plots.plot_cdfs(data, out_dir / "cdfs.png"))
        if sum(len(r["chunk_times_s"]) for r in data["records"]) <= MAX_TBT_SCATTER_POINTS:
            paths.append(plots.plot_tbt_over_time(data, out_dir / "tbt_over_time.png"))
    return paths


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
