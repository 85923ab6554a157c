"""A campaign's results as a markdown table (one row per scenario) and JSON."""

from __future__ import annotations

from chaos.campaign import ScenarioResult
from chaos.recovery import BASELINE_FRACTION, HALF_FRACTION
from chaos.sampler import summary

MIB = 1024 * 1024
COLUMNS = ("scenario", "faults", "sent", "completed", "retried", "explicit errors", "lost", "wrong", "client cancels",
           "leaked", "idle after (s)", "RSS growth (MiB)", f"recovery to {HALF_FRACTION:.0%} of baseline (s)",
           f"recovery to {BASELINE_FRACTION:.0%} of baseline (s)", "other jobs' CPU, baseline → after heal (cores)",
           "detected (s)")


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def row(result: ScenarioResult, with_reference: bool) -> list[str]:
    c = result.counts
    faults = "; ".join(f"{f.fault.label}" + ("" if f.note != "not triggered" else " (not triggered)")
                       for f in result.faults) or "none"
    leaked = sum(result.leaked.values())
    return [result.name, faults, str(c["sent"]), str(c["completed"]), str(c["retried"]), str(c["error"]), str(c["lost"]),
            str(c["wrong"]) if with_reference else "n/a", str(c["cancelled"]),
            str(leaked) if not leaked else f"{leaked} ({', '.join(f'{k}={v}' for k, v in result.leaked.items())})",
            _num(result.idle_after_s), _num(result.rss_growth_bytes / MIB),
            _num(result.recovery.to_half_s), _num(result.recovery.to_baseline_s), _other_load(result),
            _num(result.detect_s)]


def _other_load(result: ScenarioResult) -> str:
    r = result.recovery
    if r.other_cores_baseline is None and r.other_cores_after_heal is None:
        return "n/a"
    return f"{_num(r.other_cores_baseline)} → {_num(r.other_cores_after_heal)}"


def markdown(results: list[ScenarioResult], with_reference: bool = True) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r, with_reference)) + " |" for r in results]
    return "\n".join(lines) + "\n"


def failed(results: list[ScenarioResult]) -> list[str]:
    """One line per scenario that missed a target (lost, wrong or leaked not 0)."""
    out = []
    for r in results:
        bad = {k: r.counts[k] for k in ("lost", "wrong") if r.counts[k]}
        if r.leaked:
            bad["leaked"] = sum(r.leaked.values())
        if bad:
            out.append(f"{r.name}: {bad}")
    return out


def samples_markdown(result: ScenarioResult) -> str:
    """The sampled series of one scenario that moved (RSS always): first, last, max (and the RSS
    slope over the run's second half), one row each."""
    lines = ["| series | first | last | max | slope, 2nd half (MiB/h) |", "|---|---:|---:|---:|---:|"]
    for name, values in summary(result.samples).items():
        if not name.startswith("rss_mib.") and values["first"] == values["last"] == values["max"]:
            continue  # constant: capacities, limits, or never used
        slope = values.get("slope_mib_per_h")
        lines.append(f"| {name} | {values['first']} | {values['last']} | {values['max']} | "
                     f"{'' if slope is None and 'slope_mib_per_h' not in values else _num(slope)} |")
    return "\n".join(lines) + "\n"
