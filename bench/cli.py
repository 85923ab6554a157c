"""``tandem bench`` / ``python -m bench``: load-test an OpenAI-compatible endpoint."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import click
import httpx
from rich.console import Console

from bench import plots, report, roofline
from bench.arrivals import ARRIVAL_MODES, ArrivalConfig
from bench.client import ClientConfig
from bench.metrics import SLO, summarize
from bench.runner import run
from bench.synthesis import SynthesisConfig
from bench.workloads import PROMPT_SET_KINDS, TRACE_KINDS, BenchRequest, WorkloadConfig, load_workload
from bench.prompts import BUILTIN_PROMPTS, SHAREGPT_DEFAULT

console = Console(width=None if sys.stdout.isatty() else 200)  # logs and pipes: one table row a line


def run_once(requests: list[BenchRequest], arrivals: ArrivalConfig, client: ClientConfig, slo: SLO, label: str,
             settings: dict | None = None, show_progress: bool = True) -> dict:
    """Runs one load and returns its JSON (label, settings, summary, records)."""
    result = asyncio.run(run(requests, arrivals, client, show_progress=show_progress, label=label))
    return report.run_json(label, settings or {}, result, summarize(result.records, result.duration_s, slo))


def base_url(url: str) -> str:
    """The server's base URL: ``http://h:8000/v1/`` and ``http://h:8000`` both give ``http://h:8000``."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def failure_message(records: list[dict]) -> str | None:
    """None when some request succeeded; else a line quoting the first failure, with the
    server's own error message when it sent an OpenAI error body."""
    if not records or any(not r["error_kind"] for r in records):
        return None
    first = records[0]
    message = first["error"]
    try:
        error = json.loads(message)
        message = (error.get("error", error) or {}).get("message", message)
    except (ValueError, AttributeError):
        pass
    return f"all {len(records)} requests failed; the first ({first['error_kind']}): {message}"


def served_model(url: str, timeout_s: float = 10.0) -> str:
    """The first model GET /v1/models lists.

    Raises:
        click.ClickException: nothing answers at ``url`` (refused, timed out: is the server up,
            is --url right?), or it answers without listing a model (then --model helps).
    """
    models_url = f"{url.rstrip('/')}/v1/models"
    try:
        response = httpx.get(models_url, timeout=timeout_s)
    except httpx.TimeoutException:
        raise click.ClickException(f"nothing answers at {url} (no reply within {timeout_s:g} s); "
                                   "is the server up, and --url right?") from None
    except httpx.TransportError as err:
        raise click.ClickException(f"nothing answers at {url} ({err}); is the server up, and --url right?") from None
    if not response.is_success:
        raise click.ClickException(f"{models_url} answered HTTP {response.status_code}, not a model list; "
                                   "pass --model")
    try:
        models = response.json()["data"]
    except (KeyError, TypeError, ValueError):  # not JSON, or not OpenAI's shape
        models = []
    if not models:
        raise click.ClickException(f"{models_url} lists no model; pass --model")
    return models[0]["id"]


def workload_label(kind: str, path: Path | None) -> str:
    """What the requests came from, for labels and plot titles: the kind of the file read
    (``sharegpt``), or ``built-in prompts`` for a prompt set without a file."""
    return kind if path is not None else "built-in prompts"


def roofline_inputs(model: str) -> tuple[roofline.ModelFootprint, float] | None:
    """(footprint, copy bandwidth) for a bundled name or a HF folder; None when its files are not here."""
    from core.model_source import resolve_model

    try:
        footprint = roofline.ModelFootprint.from_hf_dir(resolve_model(model).converted_dir)
    except (FileNotFoundError, ValueError, KeyError) as err:
        console.print(f"[yellow]no roofline[/]: model files for {model!r} not found ({err})")
        return None
    return footprint, roofline.copy_bandwidth_bytes_per_s()


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise click.BadParameter(f"--rates must be numbers separated by commas, got {text!r}") from None
    if any(r <= 0 for r in rates):
        raise click.BadParameter(f"--rates must be > 0, got {text!r}")
    return rates


@click.command("bench")
@click.option("--url", default="http://127.0.0.1:8000", show_default=True,
              help="Server URL, with or without the trailing /v1.")
@click.option("--model", default="", help="Model name to send; default: the first of GET /v1/models.")
@click.option("--workload", "kind", type=click.Choice(PROMPT_SET_KINDS + TRACE_KINDS), default="sharegpt",
              show_default=True)
@click.option("--path", type=click.Path(exists=True, path_type=Path), default=None,
              help=f"Prompt set or trace file. Default for prompt sets: {SHAREGPT_DEFAULT} if present, "
                   "else the built-in prompts, repeated.")
@click.option("--num-requests", default=64, show_default=True, type=int, help="Cap on requests (0: all rows).")
@click.option("--max-tokens", default=0, type=int,
              help="Output tokens per request. Prompt sets: default 64; traces: 0 keeps the trace's lengths.")
@click.option("--ignore-eos", is_flag=True, help="Ask the server to ignore EOS so outputs run to max_tokens.")
@click.option("--length-scale", default=1.0, show_default=True, type=float,
              help="Traces: multiply input lengths and the 512-token hash block (e.g. 0.03125 = 1/32).")
@click.option("--output-scale", default=None, type=float, help="Traces: multiply output lengths (default: length scale).")
@click.option("--max-total-tokens", default=0, type=int, help="Traces: skip rows longer than this after scaling.")
@click.option("--arrival", type=click.Choice(ARRIVAL_MODES), default="concurrency", show_default=True)
@click.option("--concurrency", default=8, show_default=True, type=int)
@click.option("--rate", default=1.0, show_default=True, type=float, help="Poisson rate (req/s).")
@click.option("--rates", default="", help="Sweep Poisson rates, e.g. 0.5,1,2 (overrides --arrival).")
@click.option("--time-scale", default=1.0, show_default=True, type=float, help="Trace arrivals: multiply gaps.")
@click.option("--max-in-flight", default=0, type=int, help="Trace/Poisson: cap on open requests (0: none).")
@click.option("--duration", "duration_s", default=0.0, type=float, help="Send no request after this many seconds.")
@click.option("--slo-ttft-ms", default=2000.0, show_default=True, type=float)
@click.option("--slo-tbt-ms", default=200.0, show_default=True, type=float)
@click.option("--output-dir", default="bench-results", show_default=True, type=click.Path(path_type=Path))
@click.option("--seed", default=0, show_default=True, type=int)
@click.option("--roofline-model", default="SmolLM2-135M-Instruct", show_default=True,
              help="Bundled name or HF folder whose weights/KV sizes give the decode bound ('' to skip).")
@click.option("--no-progress", is_flag=True)
def bench(url: str, model: str, kind: str, path: Path | None, num_requests: int, max_tokens: int, ignore_eos: bool,
          length_scale: float, output_scale: float | None, max_total_tokens: int, arrival: str, concurrency: int,
          rate: float, rates: str, time_scale: float, max_in_flight: int, duration_s: float, slo_ttft_ms: float,
          slo_tbt_ms: float, output_dir: Path, seed: int, roofline_model: str, no_progress: bool) -> None:
    """Load-test an OpenAI-compatible endpoint with a prompt set or a real trace; write JSON and plots."""
    url = base_url(url)
    if path is None:
        if kind in TRACE_KINDS:
            raise click.UsageError(f"--workload {kind} needs --path")
        if SHAREGPT_DEFAULT.exists():
            path = SHAREGPT_DEFAULT
        else:
            console.print(f"[yellow]no prompt set at {SHAREGPT_DEFAULT}[/]: sending the {len(BUILTIN_PROMPTS)} "
                          "built-in prompts in turn (repeats hit the prefix cache); pass --path FILE for a real set")
    try:
        workload = WorkloadConfig(kind, path, num_requests, max_tokens or (64 if kind in PROMPT_SET_KINDS else 0),
                                  max_total_tokens=max_total_tokens,
                                  synthesis=SynthesisConfig(length_scale, output_scale, seed=seed))
        client = ClientConfig(url, model or served_model(url), ignore_eos=ignore_eos)
        slo = SLO(slo_ttft_ms, slo_tbt_ms)
        base = ArrivalConfig(arrival, time_scale, rate, concurrency, max_in_flight, duration_s, seed)
    except ValueError as err:
        raise click.BadParameter(str(err)) from err
    requests = load_workload(workload)
    if not requests:
        raise click.ClickException(f"no requests from {path}")
    settings = {"url": url, "model": client.model, "workload": workload_label(kind, path),
                "path": str(path or "built-in prompts"),
                "num_requests": len(requests),
                "ignore_eos": ignore_eos, "length_scale": length_scale, "seed": seed}
    limit = roofline_inputs(roofline_model) if roofline_model else None
    if rates:
        _sweep(requests, base, client, slo, _rates(rates), settings, output_dir, limit, not no_progress)
    else:
        _single(requests, base, client, slo, settings, output_dir, limit, not no_progress)


def _single(requests, arrivals, client, slo, settings, output_dir: Path, limit, show_progress: bool) -> None:
    label = f"{settings['workload']} {arrivals.mode}"
    data = run_once(requests, arrivals, client, slo, label, {**settings, "arrival": vars_of(arrivals)}, show_progress)
    _fail_if_nothing_succeeded(data, output_dir / "run.json")
    if limit:
        data["roofline"] = report.roofline_entry(data["summary"], *limit)
    console.print(report.summary_table({label: data["summary"]}))
    if data.get("roofline"):
        console.print(report.roofline_line(data["roofline"]))
    out = report.save_json(data, output_dir / "run.json")
    plots.plot_cdfs(data, output_dir / "latency_cdf.png")
    plots.plot_tbt_over_time(data, output_dir / "tbt_over_time.png")
    console.print(f"wrote {out}, latency_cdf.png, tbt_over_time.png in {output_dir}")


def _sweep(requests, base, client, slo, rates: list[float], settings, output_dir: Path, limit, show_progress) -> None:
    points = []
    for r in rates:
        arrivals = ArrivalConfig("poisson", base.time_scale, r, base.concurrency, base.max_in_flight, base.duration_s,
                                 base.seed)
        data = run_once(requests, arrivals, client, slo, f"rate {r:g}/s", {**settings, "arrival": vars_of(arrivals)},
                        show_progress)
        _fail_if_nothing_succeeded(data, output_dir / f"run_rate_{r:g}.json")
        if limit:
            data["roofline"] = report.roofline_entry(data["summary"], *limit)
        report.save_json(data, output_dir / f"run_rate_{r:g}.json")
        points.append({"rate_per_s": r, "summary": data["summary"], "roofline": data.get("roofline")})
    console.print(report.summary_table({f"rate {p['rate_per_s']:g}/s": p["summary"] for p in points}))
    sweep = {"label": f"{settings['workload']} poisson rate sweep", "settings": settings, "sweep": points}
    out = report.save_json(sweep, output_dir / "sweep.json")
    plots.plot_sweep(sweep, output_dir / "rate_sweep.png")
    console.print(f"wrote {out}, rate_sweep.png and run_rate_*.json in {output_dir}")


def _fail_if_nothing_succeeded(data: dict, path: Path) -> None:
    """Saves the run to ``path`` and exits non-zero when no request succeeded (a wrong --model,
    a wrong URL, a server down): the summary of such a run means nothing."""
    message = failure_message(data["records"])
    if message is not None:
        report.save_json(data, path)
        raise click.ClickException(f"{message} (records in {path})")


def vars_of(config) -> dict:
    return dataclasses.asdict(config)
