"""Baselines side by side on the same prompts: HF static batching vs Tandem's modes.

    .venv/bin/python benchmarks/compare.py --quick
    .venv/bin/python benchmarks/compare.py --num-prompts 200 --max-tokens 32 --concurrency 8

Every prompt goes through the model's chat template once, here; the same token ids go to HF
``generate()`` (left-padded batches of ``--concurrency``) and to each Tandem mode (a ``tandem up``
started with that mode's flags, driven by the bench client at fixed concurrency with
``ignore_eos``, then stopped). A mode whose flags ``tandem up --help`` does not list is skipped
with a message. Prints one table (absolute numbers and ratios vs HF static, and each decode step
against the memory-bandwidth bound) and writes compare.json to the output folder.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: the repo root
# Idle OpenMP threads sleep instead of spinning: on a shared 2-core machine a spinning torch pool
# next to other work made HF generate() 5x slower here. Set before torch loads; `tandem up`
# inherits it, so every row runs under the same policy.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench import report, roofline  # noqa: E402
from bench.arrivals import ArrivalConfig  # noqa: E402
from bench.cli import run_once  # noqa: E402
from bench.client import ClientConfig  # noqa: E402
from bench.hf_baseline import HFBaselineConfig, chat_token_ids, run_static  # noqa: E402
from bench.metrics import SLO  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from launcher.ports import free_port  # noqa: E402
from bench.prompts import load_prompts  # noqa: E402
from core.datasets import data_file  # noqa: E402

SHAREGPT_DEFAULT = data_file("sharegpt")  # the data folder's ShareGPT set (docs/data.md)

console = Console(width=None if sys.stdout.isatty() else 200)
TANDEM = [sys.executable, "-m", "tandem_cli"]


@dataclass(frozen=True)
class TandemMode:
    name: str
    up_flags: tuple[str, ...]  # added to `tandem up`


MODES = (
    TandemMode("tandem static", ("--colocated", "--scheduling-policy", "static")),
    TandemMode("tandem colocated continuous", ("--colocated",)),
    TandemMode("tandem disaggregated 1P+1D", ()),
)


def missing_flags(flags: tuple[str, ...], help_text: str) -> list[str]:
    return [f for f in flags if f.startswith("--") and f not in help_text]


def up_help() -> str:
    return subprocess.run([*TANDEM, "up", "--help"], capture_output=True, text=True, check=True).stdout


class TandemUp:
    """`tandem up` with extra flags as a child process; a context manager that waits for health
    and stops it with SIGINT (the launcher then stops every service)."""

    def __init__(self, flags: tuple[str, ...], log_dir: Path, timeout_s: float = 300.0):
        self.http_port = free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.argv = [*TANDEM, "up", *flags, "--http-port", str(self.http_port), "--grpc-port", str(free_port()),
                     "--log-dir", str(log_dir)]
        self.log_path = log_dir / "tandem-up.log"
        self.timeout_s = timeout_s

    def __enter__(self) -> TandemUp:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tandem up exited ({self.process.returncode}); see {self.log_path}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # polling a child's health
        self.__exit__()
        raise RuntimeError(f"tandem up not healthy after {self.timeout_s:.0f} s; see {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def run_tandem(mode: TandemMode, prompts: list[list[int]], max_tokens: int, concurrency: int, model: str,
               out_dir: Path, num_threads: int = 0) -> dict:
    requests = [BenchRequest(p, max_tokens, expected_input_tokens=len(p)) for p in prompts]
    with TandemUp((*mode.up_flags, "--num-threads", str(num_threads)), out_dir / "logs" / mode.name.replace(" ", "_")) as up:
        # Warm-up: the first request pays one-time costs (allocations, lazy imports).
        run_once(requests[:1], ArrivalConfig("concurrency", concurrency=1), ClientConfig(up.url, model, ignore_eos=True),
                 SLO(), f"{mode.name} warm-up", show_progress=False)
        data = run_once(requests, ArrivalConfig("concurrency", concurrency=concurrency),
                        ClientConfig(up.url, model, ignore_eos=True), SLO(), mode.name,
                        {"up_flags": list(mode.up_flags)})
    report.save_json(data, out_dir / f"{mode.name.replace(' ', '_')}.json")
    return data["summary"]


def comparison_table(rows: list[dict], title: str) -> Table:
    table = Table("system", "req/s", "out tok/s", "x HF req/s", "x HF tok/s", "TTFT p50 ms", "TBT mean ms",
                  "step / bound", "note", title=title)
    base = next((r for r in rows if r["name"] == "hf static" and "rps" in r), None)
    for r in rows:
        if "rps" not in r:
            table.add_row(r["name"], "-", "-", "-", "-", "-", "-", "-", r["note"])
            continue
        ratio = (lambda key: f"{r[key] / base[key]:.2f}") if base else (lambda key: "-")
        table.add_row(r["name"], f"{r['rps']:.3f}", f"{r['tps']:.1f}", ratio("rps"), ratio("tps"),
                      f"{r['ttft_p50_ms']:.0f}" if r.get("ttft_p50_ms") is not None else "-",
                      f"{r['step_ms']:.1f}", f"{r['step_over_bound']:.2f}" if r.get("step_over_bound") else "-",
                      r.get("note", ""))
    return table


@click.command()
@click.option("--prompts", "prompts_path", type=click.Path(exists=True, path_type=Path), default=SHAREGPT_DEFAULT,
              show_default=True)
@click.option("--num-prompts", default=64, show_default=True, type=int)
@click.option("--max-tokens", default=32, show_default=True, type=int)
@click.option("--concurrency", default=8, show_default=True, type=int, help="Tandem concurrency = HF batch size.")
@click.option("--max-prompt-chars", default=1000, show_default=True, type=int)
@click.option("--quick", is_flag=True, help="8 prompts, 16 tokens, concurrency 4.")
@click.option("--num-threads", default=0, show_default=True, type=int,
              help="CPU threads for HF and for the Tandem workers together (tandem up --num-threads); 0: all cores.")
@click.option("--skip-hf", is_flag=True)
@click.option("--modes", default="", help="Comma-separated subset of: static,colocated,disaggregated.")
@click.option("--output-dir", default="bench-results/compare", show_default=True, type=click.Path(path_type=Path))
def main(prompts_path: Path, num_prompts: int, max_tokens: int, concurrency: int, max_prompt_chars: int, quick: bool,
         num_threads: int, skip_hf: bool, modes: str, output_dir: Path) -> None:
    if quick:
        num_prompts, max_tokens, concurrency = 8, 16, 4
    load_1min = os.getloadavg()[0]
    if load_1min > 0.5:
        # Oversubscribed torch slows down 10-100x: numbers taken next to other work are not comparable.
        console.print(f"[yellow]warning[/]: load average {load_1min:.1f} before starting; other processes "
                      "are using the CPUs and will distort every row")
    source = resolve_model(DEFAULT_MODEL)
    subprocess.run([*TANDEM, "up", "--help"], capture_output=True, check=True)  # fail early on a broken CLI
    from engine.model.gguf_convert import ensure_hf_dir

    model_dir = ensure_hf_dir(source)
    texts = load_prompts(prompts_path, num_prompts, max_chars=max_prompt_chars)
    prompts = chat_token_ids(model_dir, texts)
    footprint = roofline.ModelFootprint.from_hf_dir(model_dir)
    bandwidth = roofline.copy_bandwidth_bytes_per_s()
    console.print(f"{len(prompts)} prompts (mean {sum(map(len, prompts)) / len(prompts):.0f} tokens), {max_tokens} "
                  f"output tokens each, concurrency/batch {concurrency}; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
    rows: list[dict] = []
    if not skip_hf:
        with Progress(TextColumn("hf static"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as progress:
            task = progress.add_task("hf", total=len(prompts))
            hf = run_static(prompts, HFBaselineConfig(model_dir, concurrency, max_tokens, num_threads),
                            on_batch=lambda done, _: progress.update(task, completed=done))
        gc.collect()
        entry = roofline.report(footprint, bandwidth, concurrency, hf["mean_prompt_tokens"] + max_tokens / 2,
                                hf["mean_step_ms"] / 1000)
        rows.append({"name": "hf static", "rps": hf["request_throughput_rps"], "tps": hf["output_throughput_tps"],
                     "ttft_p50_ms": None, "step_ms": hf["mean_step_ms"], "step_over_bound": entry["step_over_bound"],
                     "note": "step = batch time / max_tokens (prefill included)", "raw": hf, "roofline": entry})
    wanted = {m.strip() for m in modes.split(",") if m.strip()}
    help_text = up_help()
    for mode in MODES:
        if wanted and not any(w in mode.name for w in wanted):
            continue
        missing = missing_flags(mode.up_flags, help_text)
        if missing:
            console.print(f"[yellow]skipped {mode.name}[/]: `tandem up --help` does not list {', '.join(missing)}")
            rows.append({"name": mode.name, "note": f"skipped: tandem up lacks {' '.join(missing)}"})
            continue
        console.print(f"{mode.name}: tandem up {' '.join(mode.up_flags)} ...")
        s = run_tandem(mode, prompts, max_tokens, concurrency, source.name, output_dir, num_threads)
        entry = report.roofline_entry(s, footprint, bandwidth)
        errors = f"errors {s['errors_by_kind']}" if s["errors_by_kind"] else ""
        rows.append({"name": mode.name, "rps": s["request_throughput_rps"], "tps": s["output_throughput_tps"],
                     "ttft_p50_ms": s["ttft_ms"]["p50"], "step_ms": s["tbt_ms"]["mean"],
                     "step_over_bound": entry["step_over_bound"] if entry else None, "note": errors,
                     "summary": s, "roofline": entry})
    title = (f"{len(prompts)} prompts from {prompts_path.name}, {max_tokens} tokens each, concurrency {concurrency}, "
             f"threads {num_threads or os.cpu_count()}, load before start {load_1min:.1f}, "
             f"bandwidth {bandwidth / 1e9:.1f} GB/s, weights {footprint.weight_bytes / 1e6:.0f} MB")
    console.print(comparison_table(rows, title))
    report.save_json({"title": title, "rows": rows}, output_dir / "compare.json")
    console.print(f"wrote {output_dir / 'compare.json'}")


if __name__ == "__main__":
    main()
