"""PNG plots read back from the JSON results: latency CDFs, TBT over time, rate-sweep curves."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench.client import RequestRecord  # noqa: E402


def records_of(run: dict) -> list[RequestRecord]:
    """The records of one run as saved by ``bench.report.run_json``."""
    return [RequestRecord(**r) for r in run["records"]]


def plot_cdfs(run: dict, path: Path) -> Path:
    """TTFT, TBT and E2E empirical CDFs side by side."""
    ok = [r for r in records_of(run) if r.ok]
    series = {
        "TTFT (ms)": [r.ttft_s * 1000 for r in ok if r.ttft_s is not None],
        "TBT (ms)": [g * 1000 for r in ok for g in r.gaps_s],
        "E2E (s)": [r.e2e_s for r in ok if r.e2e_s is not None],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        if values:
            x = np.sort(values)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if name != "TBT (ms)" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(run.get("label", ""))
    return _save(fig, path)


def plot_tbt_over_time(run: dict, path: Path) -> Path:
    """Every inter-token gap at the moment it ended (s since the run started)."""
    ok = [r for r in records_of(run) if r.ok]
    xs = [r.start_s + t for r in ok for t in r.chunk_times_s[1:]]
    ys = [g * 1000 for r in ok for g in r.gaps_s]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.scatter(xs, ys, s=3, alpha=0.5)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("TBT (ms)")
    ax.set_title(run.get("label", ""))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_sweep(sweep: dict, path: Path) -> Path:
    """:func:`sweep_figure` saved to ``path``."""
    return _save(sweep_figure(sweep), path)


def sweep_figure(sweep: dict):
    """p50/p90 TTFT and TBT, and goodput, against the offered request rate, titled with the
    sweep's label. ``sweep``: as saved in sweep.json (``label``, ``sweep``: one point per rate)."""
    rates = [point["rate_per_s"] for point in sweep["sweep"]]
    summaries = [point["summary"] for point in sweep["sweep"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tbt_ms", "TBT (ms)")):
        for q in ("p50", "p90", "p99"):
            ax.plot(rates, [s[key][q] for s in summaries], marker="o", label=q)
        ax.set_ylabel(name)
        ax.legend()
    axes[2].plot(rates, [s["goodput_rps"] for s in summaries], marker="o", label="goodput")
    axes[2].plot(rates, [s["request_throughput_rps"] for s in summaries], marker="x", label="throughput")
    axes[2].plot(rates, rates, ls=":", color="grey", label="offered")
    axes[2].set_ylabel("req/s")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    fig.suptitle(sweep.get("label", ""))
    return fig


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
