"""The JSON a run is saved as, the roofline entry of a run, and the tables printed at the end."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from rich.table import Table

from bench import roofline
from bench.runner import RunResult


def run_json(label: str, settings: dict, result: RunResult, summary: dict) -> dict:
    """One run: what was asked, the summary and every request record (read back by bench.plots)."""
    return {"label": label, "settings": settings, "summary": summary,
            "records": [dataclasses.asdict(r) for r in result.records]}


def roofline_entry(summary: dict, footprint: roofline.ModelFootprint, bandwidth_bytes_per_s: float) -> dict | None:
    """The run's mean TBT against the bandwidth bound at its mean batch and mean context; None
    when the run produced no gaps."""
    step_ms = summary["tbt_ms"]["mean"]
    if math.isnan(step_ms):
        return None
    batch = max(1.0, summary["mean_in_flight"])
    context = summary["mean_prompt_tokens"] + summary["mean_output_tokens"] / 2
    return roofline.report(footprint, bandwidth_bytes_per_s, batch, context, step_ms / 1000)


def save_json(data: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, allow_nan=True))
    return path


def summary_table(summaries: dict[str, dict], title: str = "") -> Table:
    """One row per run: throughput, goodput and latency percentiles."""
    table = Table("run", "ok/sent", "req/s", "out tok/s", "goodput req/s", "SLO att.", "TTFT p50/p90/p99 ms",
                  "TBT p50/p90/p99 ms", "E2E p50/p99 s", "errors", title=title)
    for label, s in summaries.items():
        ttft, tbt, e2e = s["ttft_ms"], s["tbt_ms"], s["e2e_ms"]
        table.add_row(
            label, f"{s['num_ok']}/{s['num_requests']}", f"{s['request_throughput_rps']:.2f}",
            f"{s['output_throughput_tps']:.1f}", f"{s['goodput_rps']:.2f}", f"{s['slo_attainment']:.0%}",
            f"{ttft['p50']:.0f}/{ttft['p90']:.0f}/{ttft['p99']:.0f}", f"{tbt['p50']:.0f}/{tbt['p90']:.0f}/{tbt['p99']:.0f}",
            f"{e2e['p50'] / 1000:.2f}/{e2e['p99'] / 1000:.2f}", json.dumps(s["errors_by_kind"]) if s["errors_by_kind"] else "",
        )
    return table


def roofline_line(entry: dict) -> str:
    return (f"roofline: copy bandwidth {entry['bandwidth_gb_per_s']:.1f} GB/s; decode step bound "
            f"{entry['bound_ms']:.1f} ms at batch {entry['batch']:.1f}, context {entry['context_tokens']:.0f} "
            f"(weights {entry['weight_bytes'] / 1e6:.0f} MB + KV {entry['kv_bytes_per_token']} B/token); "
            f"measured mean TBT {entry['measured_step_ms']:.1f} ms = {entry['step_over_bound']:.2f}x the bound")
