"""Peers side by side on one machine, one workload, one client: HF static, vLLM, Tandem.

    export PYTHONPATH=$PWD
    .venv/bin/python benchmarks/peers.py --vllm-venv .venv-vllm            # the default workload
    .venv/bin/python benchmarks/peers.py --quick --systems vllm,colocated   # 8 prompts, 16 tokens, 4 at a time
    .venv/bin/python benchmarks/peers.py --systems colocated,disaggregated --tandem-args "--num-threads 2"

Every prompt goes through the model's chat template once, here; the same token ids go to every
system. HF ``generate()`` runs left-padded batches of ``--concurrency`` in this process; each
server (vLLM's OpenAI server, ``tandem up --colocated``, ``tandem up``) is started alone, gets one
warm-up request, is driven by the bench client at fixed concurrency with ``ignore_eos``, and is
stopped before the next starts: never two systems at once. A system that cannot be installed,
started or measured becomes a row saying why. Prints one table (ratios to vLLM) and writes
peers.json (every number, the settings, the machine) and one run JSON per system.
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: the repo root

from benchmarks import peer_report, vllm_peer  # noqa: E402
from benchmarks.compare import TANDEM, TandemUp, console  # noqa: E402  (sets OMP_WAIT_POLICY; see --omp-wait-policy)
from bench import report, roofline  # noqa: E402
from bench.arrivals import ArrivalConfig  # noqa: E402
from bench.cli import failure_message, run_once  # noqa: E402
from bench.client import ClientConfig  # noqa: E402
from bench.hf_baseline import HFBaselineConfig, chat_token_ids, run_static, static_records  # noqa: E402
from bench.metrics import SLO, summarize  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from bench.prompts import BUILTIN_PROMPTS, load_prompts  # noqa: E402
from core.datasets import data_file  # noqa: E402
from engine.model.linear_chooser import BUSY_OTHER_CORES, other_cores_now  # noqa: E402

SHAREGPT_DEFAULT = data_file("sharegpt")  # the data folder's ShareGPT set (docs/data.md)

SYSTEMS = {  # --systems key: the row's name
    "hf": "hf static",
    "vllm": "vllm",
    "colocated": "tandem colocated",
    "disaggregated": "tandem disaggregated 1P+1D",
}
TANDEM_FLAGS = {"colocated": ("--colocated",), "disaggregated": ()}
QUIET_WAIT_S = 90.0  # the longest a system waits for the machine to be quiet before it starts anyway


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # chat-templated token ids, the same for every system
    max_tokens: int  # output tokens per request (EOS ignored)
    concurrency: int  # client slots = HF batch size
    slo: SLO
    model_name: str  # the name every server serves and the client sends
    model_dir: Path  # the Hugging Face folder every system loads


@dataclass(frozen=True)
class PeerOptions:
    device: str  # cpu | cuda
    vllm_venv: Path
    vllm_args: tuple[str, ...]  # after vllm_peer.default_args
    install_vllm: bool
    tandem_args: tuple[str, ...]  # added to both Tandem rows' `tandem up`
    output_dir: Path
    dtype: str = "float32"  # weights and KV of every system
    vllm_cpu_bind: str = "all"  # vllm_peer.cpu_bind


def requests_of(workload: Workload) -> list[BenchRequest]:
    return [BenchRequest(p, workload.max_tokens, expected_input_tokens=len(p)) for p in workload.prompts]


def drive(url: str, workload: Workload, label: str, out_dir: Path) -> dict:
    """One warm-up request (one-time costs), then the workload at fixed concurrency; returns the
    summary. Raises RuntimeError when no request succeeded (records saved first)."""
    requests = requests_of(workload)
    client = ClientConfig(url, workload.model_name, ignore_eos=True)
    run_once(requests[:1], ArrivalConfig("concurrency", concurrency=1), client, workload.slo, f"{label} warm-up",
             show_progress=False)
    data = run_once(requests, ArrivalConfig("concurrency", concurrency=workload.concurrency), client, workload.slo,
                    label, {"url": url})
    path = report.save_json(data, out_dir / f"{label.replace(' ', '_')}.json")
    message = failure_message(data["records"])
    if message is not None:
        raise RuntimeError(f"{message} (records in {path})")
    return data["summary"]


def errors_note(summary: dict) -> str:
    return f"errors {summary['errors_by_kind']}" if summary["errors_by_kind"] else ""


def run_hf(workload: Workload, options: PeerOptions) -> dict:
    """HF static batches in this process; the closed-loop view of them (bench.hf_baseline.static_records)."""
    config = HFBaselineConfig(workload.model_dir, workload.concurrency, workload.max_tokens)
    run_static(workload.prompts[:1], HFBaselineConfig(workload.model_dir, 1, 2))  # warm-up, like the servers get
    result = run_static(workload.prompts, config)
    gc.collect()
    records = static_records(result, workload.prompts)
    summary = summarize(records, result["duration_s"], workload.slo)
    report.save_json({"label": "hf static", "summary": summary, "raw": result}, options.output_dir / "hf_static.json")
    return peer_report.metric_row(SYSTEMS["hf"], summary, "TTFT = its batch's prefill")


def run_vllm(workload: Workload, options: PeerOptions) -> dict:
    versions, why = vllm_peer.vllm_versions(options.vllm_venv)
    if versions is None and options.install_vllm:
        console.print(f"vllm: {why}; running {vllm_peer.INSTALL_SCRIPT} {options.vllm_venv}")
        vllm_peer.install(options.vllm_venv, options.device)
        versions, why = vllm_peer.vllm_versions(options.vllm_venv)
    if versions is None:
        return peer_report.unavailable_row(
            SYSTEMS["vllm"], f"not installed ({why}): run scripts/install_vllm.sh {options.vllm_venv}, or pass --install-vllm")
    env = ()
    if options.device == "cpu":
        env = (("VLLM_CPU_OMP_THREADS_BIND", vllm_peer.cpu_bind(options.vllm_cpu_bind, os.cpu_count() or 1)),)
    config = vllm_peer.VLLMServerConfig(
        options.vllm_venv, workload.model_dir, workload.model_name,
        vllm_peer.default_args(options.device) + options.vllm_args, options.output_dir / "logs" / "vllm.log",
        env=env, dtype=options.dtype)
    console.print(f"vllm {versions['vllm']}: starting (startup compiles; minutes on CPU) ...")
    with vllm_peer.VLLMServer(config) as server:
        console.print(f"vllm ready after {server.startup_s:.0f} s")
        summary = drive(server.url, workload, "vllm", options.output_dir)
    binding = vllm_peer.thread_binding(config.log_path)
    cores = vllm_peer.bound_cores(binding)
    handicap = ""
    if options.device == "cpu" and cores is not None and cores < (os.cpu_count() or 1):
        handicap = f"HANDICAPPED: model bound to {cores} of {os.cpu_count()} cores"
    row = peer_report.metric_row(SYSTEMS["vllm"], summary, "; ".join(n for n in (handicap, errors_note(summary)) if n))
    return {**row, "versions": versions, "startup_s": server.startup_s, "argv": server.argv, "env": dict(env),
            "thread_binding": binding, "bound_cores": cores, "handicapped": bool(handicap)}


def run_tandem(key: str, workload: Workload, options: PeerOptions) -> dict:
    flags = (*TANDEM_FLAGS[key], *options.tandem_args)
    name = SYSTEMS[key]
    console.print(f"{name}: tandem up {shlex.join(flags)} ...")
    started = time.monotonic()
    log_dir = options.output_dir / "logs" / name.replace(" ", "_")
    with TandemUp(flags, log_dir) as up:
        startup_s = time.monotonic() - started
        summary = drive(up.url, workload, name, options.output_dir)
    row = peer_report.metric_row(name, summary, errors_note(summary))
    return {**row, "up_flags": list(flags), "startup_s": startup_s, "linear_backends": linear_backends(log_dir),
            "thread_split": thread_split(key, options.tandem_args), "core_sharing": log_lines(log_dir, "core sharing")}


def linear_backends(log_dir: Path) -> dict[str, str]:
    """Each worker log's "linear backends: ..." line (engine.model.linear_chooser), by log name."""
    return log_lines(log_dir, "linear backends:")


def log_lines(log_dir: Path, marker: str) -> dict[str, str]:
    """Each service log's last line containing ``marker``, from the marker on, by log name (e.g.
    the workers' "core sharing ..." line: engine.core_share)."""
    found = {}
    for path in sorted(log_dir.glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if marker in line:
                try:  # a JSON log line (core.logging_setup); else the plain line
                    line = json.loads(line)["msg"]
                except (ValueError, KeyError, TypeError):
                    pass
                found[path.stem] = line[line.index(marker):].strip()
    return found


def thread_split(key: str, tandem_args: tuple[str, ...]) -> dict[str, int]:
    """The torch threads ``tandem up`` gives each worker role (launcher.local_cluster.worker_threads);
    a decode worker that shares the prefill cores adds theirs while prefill is idle (the row's
    ``core_sharing``)."""
    from launcher.commands import worker_threads

    args = list(tandem_args)
    total = int(args[args.index("--num-threads") + 1]) if "--num-threads" in args else 0
    return worker_threads(total or os.cpu_count() or 2, colocated=key == "colocated")


def wait_until_quiet(max_wait_s: float = QUIET_WAIT_S, probe=other_cores_now) -> float:
    """Waits until processes other than this one use at most ``BUSY_OTHER_CORES`` cores over one
    probe window (``engine.model.linear_chooser.other_cores_now``), at most ``max_wait_s``; returns
    the last window's cores. Once, right after a bfloat16 vLLM row on a 2-core AMD EPYC Zen 5,
    other processes kept a core busy: the Tandem row started then timed its GEMM backends, and
    ran, beside them at 0.11x."""
    deadline = time.monotonic() + max_wait_s
    while True:
        cores = probe()
        if cores <= BUSY_OTHER_CORES or time.monotonic() >= deadline:
            return cores


def run_system(key: str, workload: Workload, options: PeerOptions) -> dict:
    """The system's row, started once the machine is quiet (:func:`wait_until_quiet`; a row
    that started beside other work says so in its note and ``other_cores_at_start``); an
    exception (missing install, failed start, every request failing) becomes an unavailable row
    with the reason, and the traceback goes to the console."""
    busy = wait_until_quiet()
    row = _run_system(key, workload, options)
    row["other_cores_at_start"] = round(busy, 2)
    if busy > BUSY_OTHER_CORES:
        console.print(f"[yellow]{SYSTEMS[key]}: other processes kept {busy:.2f} cores busy at its start[/]")
        row["note"] = "; ".join(n for n in (row.get("note", ""), f"started beside {busy:.2f} busy cores") if n)
    return row


def _run_system(key: str, workload: Workload, options: PeerOptions) -> dict:
    try:
        if key == "hf":
            return run_hf(workload, options)
        if key == "vllm":
            return run_vllm(workload, options)
        return run_tandem(key, workload, options)
    except Exception as err:  # noqa: BLE001  (one peer failing must not lose the others' rows)
        console.print(f"[red]{SYSTEMS[key]} failed[/]: {traceback.format_exc(limit=3)}")
        return peer_report.unavailable_row(SYSTEMS[key], f"failed: {type(err).__name__}: {err}")


def machine_info(device: str) -> dict:
    """What the numbers were measured on, taken before the first system starts."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    info = {"cpu_model": model, "cpu_count": os.cpu_count(), "load_average_at_start": list(os.getloadavg()),
            "uptime_at_start": uptime, "platform": platform.platform(), "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"), "transformers": importlib.metadata.version("transformers"),
            "device": device, "copy_bandwidth_gb_per_s": roofline.copy_bandwidth_bytes_per_s() / 1e9,
            "git_commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                         cwd=vllm_peer.REPO).stdout.strip()}
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def load_workload(prompts_path: Path, num_prompts: int, max_prompt_chars: int) -> tuple[list[str], str]:
    """(prompt texts, where they came from); the built-in prompts, repeated, when the file is missing."""
    if prompts_path.is_file():
        return load_prompts(prompts_path, num_prompts, max_chars=max_prompt_chars), str(prompts_path)
    console.print(f"[yellow]no prompt set at {prompts_path}[/]: using the {len(BUILTIN_PROMPTS)} built-in prompts, "
                  "repeated (repeats hit the prefix caches; pass --prompts FILE for numbers that mean something)")
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(num_prompts)], "built-in prompts (file missing)"


def parse_systems(text: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SYSTEMS]
    if unknown or not keys:
        raise click.BadParameter(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}, got {text!r}")
    return [k for k in SYSTEMS if k in keys]  # the table's order, whatever the order given


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def set_omp_wait_policy(policy: str) -> None:
    """One OpenMP wait policy for every row: HF runs here, and every server inherits it."""
    if policy:
        os.environ["OMP_WAIT_POLICY"] = policy
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)


@click.command()
@click.option("--systems", default=",".join(SYSTEMS), show_default=True, help="Rows to run, comma-separated.")
@click.option("--prompts", "prompts_path", type=click.Path(path_type=Path), default=SHAREGPT_DEFAULT,
              envvar="TANDEM_PEERS_PROMPTS", show_default=True,
              help="Prompt set (ShareGPT JSON, ...); env TANDEM_PEERS_PROMPTS. Missing: built-in prompts.")
@click.option("--num-prompts", default=64, show_default=True, type=int)
@click.option("--concurrency", default=16, show_default=True, type=int, help="Client slots = HF batch size.")
@click.option("--max-tokens", default=64, show_default=True, type=int, help="Output tokens per request (EOS ignored).")
@click.option("--max-prompt-chars", default=2000, show_default=True, type=int, help="Longer prompts are skipped.")
@click.option("--quick", is_flag=True, help="8 prompts, concurrency 4, 16 tokens.")
@click.option("--slo-ttft-ms", default=2000.0, show_default=True, type=float)
@click.option("--slo-tbt-ms", default=200.0, show_default=True, type=float)
@click.option("--tandem-args", default="", help='Extra `tandem up` arguments for both Tandem rows, e.g. "--num-threads 2".')
@click.option("--vllm-venv", type=click.Path(path_type=Path), default=vllm_peer.DEFAULT_VENV, show_default=True)
@click.option("--vllm-args", default="", help="Extra vLLM server arguments (after the defaults in the docs).")
@click.option("--install-vllm", is_flag=True, help="Run scripts/install_vllm.sh when --vllm-venv lacks vllm.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Which vLLM build and flags; auto: cuda when torch sees a GPU.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Weights and KV cache of every system (vLLM --dtype, tandem up --dtype).")
@click.option("--vllm-cpu-bind", default="all", show_default=True,
              help="VLLM_CPU_OMP_THREADS_BIND: all = every core (0-<n-1>, vLLM at its best); auto = vLLM's "
                   "default (reserves a core for its front end: one of two cores on a 2-core machine).")
@click.option("--omp-wait-policy", default="", show_default=True,
              help="OMP_WAIT_POLICY for every row ('' leaves it unset).")
@click.option("--output-dir", default="bench-results/peers", show_default=True, type=click.Path(path_type=Path))
def main(systems: str, prompts_path: Path, num_prompts: int, concurrency: int, max_tokens: int, max_prompt_chars: int,
         quick: bool, slo_ttft_ms: float, slo_tbt_ms: float, tandem_args: str, vllm_venv: Path, vllm_args: str,
         install_vllm: bool, device: str, dtype: str, vllm_cpu_bind: str, omp_wait_policy: str,
         output_dir: Path) -> None:
    """Run HF static, vLLM and Tandem one after another on the same prompts; print one table."""
    if quick:
        num_prompts, concurrency, max_tokens = 8, 4, 16
    keys = parse_systems(systems)
    set_omp_wait_policy(omp_wait_policy)
    try:
        slo = SLO(slo_ttft_ms, slo_tbt_ms)
    except ValueError as err:
        raise click.BadParameter(str(err)) from err
    device = resolve_device(device)
    machine = machine_info(device)
    console.print(f"machine: {machine['cpu_model']}, {machine['cpu_count']} CPUs, {machine['uptime_at_start']}")
    subprocess.run([*TANDEM, "up", "--help"], capture_output=True, check=True)  # fail early on a broken CLI
    from engine.model.gguf_convert import ensure_hf_dir

    source = resolve_model(DEFAULT_MODEL)
    texts, prompts_from = load_workload(prompts_path, num_prompts, max_prompt_chars)
    workload = Workload(chat_token_ids(ensure_hf_dir(source), texts), max_tokens, concurrency, slo, source.name,
                        ensure_hf_dir(source))
    tandem_flags = tuple(shlex.split(tandem_args)) + (("--dtype", dtype) if dtype != "float32" else ())
    options = PeerOptions(device, vllm_venv.resolve(), tuple(shlex.split(vllm_args)), install_vllm,
                          tandem_flags, output_dir, dtype, vllm_cpu_bind)
    mean_prompt = sum(map(len, workload.prompts)) / len(workload.prompts)
    console.print(f"{len(workload.prompts)} prompts from {prompts_from} (mean {mean_prompt:.0f} tokens after the chat "
                  f"template), {max_tokens} output tokens each, concurrency {concurrency}")
    rows = peer_report.with_ratios([run_system(key, workload, options) for key in keys])
    title = (f"{len(workload.prompts)} prompts, mean {mean_prompt:.0f} tokens in, {max_tokens} out (EOS ignored), "
             f"concurrency {concurrency}; goodput at TTFT {slo.ttft_ms:.0f} ms / TBT {slo.tbt_ms:.0f} ms; "
             f"load before start {machine['load_average_at_start'][0]:.1f}")
    console.print(peer_report.peer_table(rows, title))
    settings = {"systems": keys, "prompts": prompts_from, "num_prompts": len(workload.prompts),
                "mean_prompt_tokens": mean_prompt, "max_tokens": max_tokens, "concurrency": concurrency,
                "ignore_eos": True, "chat_template": "applied once here; token ids to /v1/completions",
                "slo": {"ttft_ms": slo.ttft_ms, "tbt_ms": slo.tbt_ms}, "model": str(workload.model_dir),
                "dtype": dtype, "tandem_args": list(options.tandem_args), "vllm_cpu_bind": vllm_cpu_bind,
                "vllm_args": list(vllm_peer.default_args(device) + options.vllm_args),
                "omp_wait_policy": omp_wait_policy}
    out = report.save_json({"title": title, "settings": settings, "machine": machine, "rows": rows,
                            "markdown": peer_report.markdown_table(rows)}, output_dir / "peers.json")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
