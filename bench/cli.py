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
from core.datasets import DATA_DIR_ENV, data_dir, default_file, where_to_get
from bench.prompts import BUILTIN_PROMPTS

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
    hint = "; pass --api-key KEY (or set TANDEM_API_KEY)" if first["error_kind"] in ("http_401", "http_403") else ""
    return f"all {len(records)} requests failed; the first ({first['error_kind']}): {message}{hint}"


def served_model(url: str, timeout_s: float = 10.0, api_key: str = "") -> str:
    """The first model GET /v1/models lists (``api_key``: sent as a Bearer token).

    Raises:
        click.ClickException: nothing answers at ``url`` (refused, timed out: is the server up,
            is --url right?), it wants an API key (401, 403: --api-key), or it answers without
            listing a model (then --model helps).
    """
    models_url = f"{url.rstrip('/')}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(models_url, timeout=timeout_s, headers=headers)
    except httpx.TimeoutException:
        raise click.ClickException(f"nothing answers at {url} (no reply within {timeout_s:g} s); "
                                   "is the server up, and --url right?") from None
    except httpx.TransportError as err:
        raise click.ClickException(f"nothing answers at {url} ({err}); is the server up, and --url right?") from None
    if response.status_code in (401, 403):
        said = "refused the API key" if api_key else "wants an API key"
        raise click.ClickException(f"{models_url} answered HTTP {response.status_code}: the server {said}; "
                                   "pass --api-key KEY (or set TANDEM_API_KEY)")
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


def workload_path(kind: str, path: Path | None, folder: Path, say=None) -> Path | None:
    """The file workload ``kind`` reads: ``path``, else its data set in the data folder ``folder``
    (core.datasets), else for a prompt set None (the built-in prompts; ``say`` gets a note that
    says so and where to get a real set).

    Raises:
        click.UsageError: a trace kind with no file, naming where to get it.
    """
    if path is not None:
        return path
    found = default_file(kind, folder)
    if found is not None:
        return found
    if kind in TRACE_KINDS:
        raise click.UsageError(f"--workload {kind} needs --path FILE; get {where_to_get(kind, folder)}")
    if say is not None:
        get = f"; get {where_to_get(kind, folder)}" if kind in ("sharegpt", "alpaca") else ""
        say(f"[yellow]no --path and no {kind} prompt set in {folder}[/]: the {len(BUILTIN_PROMPTS)} built-in "
            f"prompts, repeated (repeats hit the prefix cache: the numbers mean little){get}")
    return None


def data_dir_option(f):
    """``--data-dir`` (env TANDEM_DATA_DIR): where data sets are looked for without --path."""
    return click.option("--data-dir", "data_folder", envvar=DATA_DIR_ENV, default=None,
                        type=click.Path(file_okay=False, path_type=Path),
                        help="Folder of the public data sets (docs/data.md), read when --path is not given "
                             "[env TANDEM_DATA_DIR; default: ~/.cache/tandem/data].")(f)


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
@click.option("--url", default=None,
              help="Server URL, with or without the trailing /v1. Default: the cluster tandem up runs on this "
                   "machine, else http://127.0.0.1:8000.")
@click.option("--model", default="", help="Model name to send; default: the first of GET /v1/models.")
@click.option("--workload", "kind", type=click.Choice(PROMPT_SET_KINDS + TRACE_KINDS), default="sharegpt",
              show_default=True)
@click.option("--path", type=click.Path(exists=True, path_type=Path), default=None,
              help="Prompt set or trace file. Default: the workload's data set in --data-dir (docs/data.md); "
                   "for prompt sets without one, the built-in prompts, repeated.")
@data_dir_option
@click.option("--api-key", default="", envvar="TANDEM_API_KEY",
              help="Sent as 'Authorization: Bearer KEY' (a router started with --api-key) [env TANDEM_API_KEY: "
                   "the first of its space-separated keys].")
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
def bench(url: str | None, model: str, kind: str, path: Path | None, data_folder: Path | None, api_key: str,
          num_requests: int, max_tokens: int, ignore_eos: bool,
          length_scale: float, output_scale: float | None, max_total_tokens: int, arrival: str, concurrency: int,
          rate: float, rates: str, time_scale: float, max_in_flight: int, duration_s: float, slo_ttft_ms: float,
          slo_tbt_ms: float, output_dir: Path, seed: int, roofline_model: str, no_progress: bool) -> None:
    """Load-test an OpenAI-compatible endpoint with a prompt set or a real trace; write JSON and plots."""
    if url is None:
        from core.cluster_record import choose_url, running

        url = choose_url(None, running())[0]
    url = base_url(url)
    api_key = (api_key.split() or [""])[0]
    path = workload_path(kind, path, data_dir(data_folder), console.print)
    try:
        workload = WorkloadConfig(kind, path, num_requests, max_tokens or (64 if kind in PROMPT_SET_KINDS else 0),
                                  max_total_tokens=max_total_tokens,
                                  synthesis=SynthesisConfig(length_scale, output_scale, seed=seed))
        client = ClientConfig(url, model or served_model(url, api_key=api_key), ignore_eos=ignore_eos, api_key=api_key)
        slo = SLO(slo_ttft_ms, slo_tbt_ms)
        base = ArrivalConfig(arrival, time_scale, rate, concurrency, max_in_flight, duration_s, seed)
    except ValueError as err:
        raise click.BadParameter(str(err)) from err
    requests = load_workload(workload)
    if not requests:
        raise click.ClickException(f"no requests from {path}")
    settings = {"url": url, "model": client.model, "workload": workload_label(kind, path),
                "path": str(path or "built-in prompts"),
                "num_requests": len(requests), "max_tokens": workload.max_tokens,
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
