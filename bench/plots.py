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


def slo_of(run: dict) -> dict | None:
    """The run's SLO (``ttft_ms``, ``tbt_ms``) as its summary recorded it; None when absent."""
    slo = (run.get("summary") or {}).get("slo")
    return slo if slo and slo.get("ttft_ms") and slo.get("tbt_ms") else None


def title_of(run: dict) -> str:
    """The run's label, then its settings: model, requests, output tokens, arrivals, SLO."""
    settings, slo = run.get("settings") or {}, slo_of(run)
    arrival = settings.get("arrival") or {}
    mode = arrival.get("mode")
    load = {"concurrency": f"concurrency {arrival.get('concurrency')}",
            "poisson": f"Poisson {arrival.get('rate_per_s'):g} req/s" if arrival.get("rate_per_s") else "Poisson",
            "trace": f"trace arrivals x {arrival.get('time_scale', 1):g}"}.get(mode, mode)
    parts = [settings.get("model"), f"{settings['num_requests']} requests" if "num_requests" in settings else None,
             f"max_tokens {settings['max_tokens']}" if settings.get("max_tokens") else None,
             "ignore_eos" if settings.get("ignore_eos") else None, load,
             f"SLO TTFT {slo['ttft_ms']:g} ms, TBT {slo['tbt_ms']:g} ms" if slo else None]
    details = ", ".join(p for p in parts if p)
    return f"{run.get('label', '')}\n{details}" if details else run.get("label", "")


def plot_cdfs(run: dict, path: Path) -> Path:
    """:func:`cdf_figure` saved to ``path``."""
    return _save(cdf_figure(run), path)


def cdf_figure(run: dict):
    """TTFT, TBT and E2E empirical CDFs side by side, the SLOs as dashed lines, the settings in
    the title."""
    ok = [r for r in records_of(run) if r.ok]
    slo = slo_of(run) or {}
    series = {
        "TTFT (ms)": ([r.ttft_s * 1000 for r in ok if r.ttft_s is not None], slo.get("ttft_ms")),
        "TBT (ms)": ([g * 1000 for r in ok for g in r.gaps_s], slo.get("tbt_ms")),
        "E2E (s)": ([r.e2e_s for r in ok if r.e2e_s is not None], None),
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, (name, (values, limit)) in zip(axes, series.items()):
        if values:
            x = np.sort(values)
            ax.step(x, np.arange(1, len(x) + 1) / len(x), where="post", label="measured")
        if limit:
            ax.axvline(limit, color="tab:red", ls="--", lw=1, label=f"SLO {limit:g} ms")
            ax.legend(loc="lower right", fontsize="small")
        ax.set_xlabel(name)
        ax.set_ylabel("fraction of requests" if name != "TBT (ms)" else "fraction of gaps")
        ax.grid(alpha=0.3)
    fig.suptitle(title_of(run))
    return fig


def plot_tbt_over_time(run: dict, path: Path) -> Path:
    """:func:`tbt_figure` saved to ``path``."""
    return _save(tbt_figure(run), path)


def tbt_figure(run: dict):
    """Every inter-token gap at the moment it ended (s since the run started): within the TBT
    SLO in blue, over it in red (a dashed line at the SLO), the settings in the title."""
    ok = [r for r in records_of(run) if r.ok]
    xs = np.array([r.start_s + t for r in ok for t in r.chunk_times_s[1:]])
    ys = np.array([g * 1000 for r in ok for g in r.gaps_s])
    limit = (slo_of(run) or {}).get("tbt_ms")
    fig, ax = plt.subplots(figsize=(9, 4))
    over = ys > limit if limit else np.zeros(len(ys), dtype=bool)
    ax.scatter(xs[~over], ys[~over], s=3, alpha=0.5, color="tab:blue",
               label=f"gap within the SLO ({int((~over).sum())})" if limit else f"gap ({len(ys)})")
    if limit:
        ax.scatter(xs[over], ys[over], s=3, alpha=0.5, color="tab:red", label=f"gap over the SLO ({int(over.sum())})")
        ax.axhline(limit, color="tab:red", ls="--", lw=1, label=f"TBT SLO {limit:g} ms")
    ax.plot([], [], ls="", label="darker dots: several gaps on one spot")
    ax.legend(loc="upper right", fontsize="small", markerscale=3)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("TBT (ms)")
    ax.set_title(title_of(run), fontsize="medium")
    ax.grid(alpha=0.3)
    return fig


def plot_sweep(sweep: dict, path: Path) -> Path:
    """:func:`sweep_figure` saved to ``path``."""
    return _save(sweep_figure(sweep), path)


def sweep_figure(sweep: dict):
    """p50/p90 TTFT and TBT, and goodput, against the offered request rate, titled with the
    sweep's label. ``sweep``: as saved in sweep.json (``label``, ``sweep``: one point per rate)."""
    rates = [point["rate_per_s"] for point in sweep["sweep"]]
    summaries = [point["summary"] for point in sweep["sweep"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    slo = (summaries[0].get("slo") or {}) if summaries else {}
    for ax, key, name in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tbt_ms", "TBT (ms)")):
        for q in ("p50", "p90", "p99"):
            ax.plot(rates, [s[key][q] for s in summaries], marker="o", label=q)
        if slo.get(key):
            ax.axhline(slo[key], color="tab:red", ls="--", lw=1, label=f"SLO {slo[key]:g} ms")
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
