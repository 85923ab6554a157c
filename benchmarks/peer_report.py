"""The rows of the peer benchmark (benchmarks/peers.py) and its one table: pure functions of numbers.

A row is a plain dict: ``system``, ``status`` ("ok", or "unavailable" for a peer that could not be
installed, started or measured, with the reason in ``note``), and for an ok row the headline
numbers taken from a :func:`bench.metrics.summarize` summary plus ratios to the baseline row
(vLLM by default): ``x_tps`` (higher is better), ``x_tbt`` (TBT p50 over the baseline's: lower is
better) and ``x_goodput``. A ratio is None when either side is missing or the baseline's is 0.
"""

from __future__ import annotations

import math

from rich.table import Table

BASELINE = "vllm"


def metric_row(system: str, summary: dict, note: str = "") -> dict:
    """An ok row from a ``bench.metrics.summarize`` summary (rates per s, times in ms)."""
    return {"system": system, "status": "ok", "note": note,
            "num_ok": summary["num_ok"], "num_requests": summary["num_requests"],
            "tps": summary["output_throughput_tps"], "rps": summary["request_throughput_rps"],
            "tbt_p50_ms": summary["tbt_ms"]["p50"], "ttft_p50_ms": summary["ttft_ms"]["p50"],
            "goodput_rps": summary["goodput_rps"], "slo_attainment": summary["slo_attainment"],
            "summary": summary}


def unavailable_row(system: str, reason: str) -> dict:
    """The row of a peer that could not be installed, started or measured: the table says why."""
    return {"system": system, "status": "unavailable", "note": reason}


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None or math.isnan(value) or math.isnan(base) or base == 0:
        return None
    return value / base


def with_ratios(rows: list[dict], baseline: str = BASELINE) -> list[dict]:
    """Copies of ``rows`` with ``x_tps``, ``x_tbt``, ``x_goodput`` against the ok row named
    ``baseline`` (all None when that row is missing or unavailable)."""
    base = next((r for r in rows if r["system"] == baseline and r["status"] == "ok"), None)
    out = []
    for row in rows:
        if row["status"] != "ok":
            out.append(dict(row))
            continue
        get = (lambda key: base[key]) if base else (lambda key: None)
        out.append({**row, "x_tps": _ratio(row["tps"], get("tps")), "x_tbt": _ratio(row["tbt_p50_ms"], get("tbt_p50_ms")),
                    "x_goodput": _ratio(row["goodput_rps"], get("goodput_rps"))})
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, spec)


COLUMNS = ("system", "ok/sent", "out tok/s", "TBT p50 ms", "TTFT p50 ms", "goodput req/s")


def _cells(row: dict) -> list[str]:
    """The row's cells after ``system`` and before ``note``: six numbers and three ratios."""
    if row["status"] != "ok":
        return ["-"] * 8
    return [f"{row['num_ok']}/{row['num_requests']}", _fmt(row["tps"], ".1f"), _fmt(row["tbt_p50_ms"], ".0f"),
            _fmt(row["ttft_p50_ms"], ".0f"), _fmt(row["goodput_rps"], ".3f"), _fmt(row.get("x_tps"), ".2f"),
            _fmt(row.get("x_tbt"), ".2f"), _fmt(row.get("x_goodput"), ".2f")]


def _header(baseline: str) -> list[str]:
    return [*COLUMNS, f"tok/s x {baseline}", f"TBT x {baseline}", f"goodput x {baseline}", "note"]


def peer_table(rows: list[dict], title: str = "", baseline: str = BASELINE) -> Table:
    """One line per system; ``rows`` as returned by :func:`with_ratios`."""
    table = Table(*_header(baseline), title=title)
    for row in rows:
        table.add_row(row["system"], *_cells(row), row["note"])
    return table


def markdown_table(rows: list[dict], baseline: str = BASELINE) -> str:
    """The same table as Markdown, for pasting into docs."""
    header = _header(baseline)
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 2) + "---|"]
    lines += ["| " + " | ".join([row["system"], *_cells(row), row["note"]]) + " |" for row in rows]
    return "\n".join(lines)
