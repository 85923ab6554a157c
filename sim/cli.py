"""``tandem sim`` and ``tandem plan``."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from bench.cli import workload_path
from bench.metrics import SLO
from bench.report import summary_table
from bench.workloads import PROMPT_SET_KINDS, TRACE_KINDS
from core.kv_cache_spec import KV_CACHE_DTYPES
from core.settings import ByteSize
from sim.hardware import GPUS, MODELS
from sim.output import result_json, save
from sim.setup import (ClusterChoice, WorkloadChoice, build_cluster, build_worker, kv_footprint, load_requests,
                       router_spec)
from sim.simulator import Simulation

console = Console(width=None if sys.stdout.isatty() else 200)


def workload_options(f, block_size: int = 16, max_candidates: int = 8):
    options = [
        click.option("--workload", "kind", default="mooncake", show_default=True,
                     type=click.Choice(TRACE_KINDS + PROMPT_SET_KINDS)),
        click.option("--path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Trace or prompt file. Default: the workload's data set in --data-dir (docs/data.md)."),
        click.option("--data-dir", "data_folder", envvar="TANDEM_DATA_DIR", default=None,
                     type=click.Path(file_okay=False, path_type=Path),
                     help="Folder of the public data sets, read when --path is not given "
                          "[env TANDEM_DATA_DIR; default: ~/.cache/tandem/data]."),
        click.option("--num-requests", default=0, show_default=True, type=int, help="0: every row."),
        click.option("--time-scale", default=1.0, show_default=True, type=float,
                     help="Trace arrival = trace time x this (0.5: twice the rate)."),
        click.option("--rate", "rate_per_s", default=0.0, show_default=True, type=float,
                     help="Poisson arrivals at this rate instead of the trace's (prompt sets: required)."),
        click.option("--max-tokens", default=0, show_default=True, type=int,
                     help="Output tokens per request (prompt sets: required; traces: 0 keeps the trace's)."),
        click.option("--gpu", default="H200", show_default=True, type=click.Choice(sorted(GPUS))),
        click.option("--model", default="llama-3.1-8b", show_default=True, type=click.Choice(sorted(MODELS))),
        click.option("--cost-model", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Time steps with this fitted CostModel JSON (fields, or a heartbeat's cost_* load) "
                          "instead of the GPU roofline."),
        click.option("--block-size", default=block_size, show_default=True, type=int),
        click.option("--num-kv-blocks", default=0, show_default=True, type=int, help="0: what fits the GPU."),
        click.option("--kv-cache-dtype", default="auto", show_default=True, type=click.Choice(KV_CACHE_DTYPES),
                     help="The workers' KV cache dtype: auto keeps K/V in the model's (bf16); fp8 and int8 store "
                          "head_dim bytes + a float32 scale per token and KV head (transfers, pool and GPU blocks, "
                          "attention reads)."),
        click.option("--pool-capacity-bytes", default=0, show_default=True, type=ByteSize(),
                     help="The KV pool's DRAM, all nodes together (bytes or a size such as 4TiB); it holds this "
                          "over a block's bytes. 0: 4,194,304 blocks, whatever their size."),
        click.option("--max-num-seqs", default=256, show_default=True, type=int),
        click.option("--max-num-batched-tokens", default=8192, show_default=True, type=int),
        click.option("--max-model-len", default=0, show_default=True, type=int, help="0: the model's."),
        click.option("--routing-policy", default="predicted_latency", show_default=True,
                     type=click.Choice(["round_robin", "least_loaded", "cache_aware", "predicted_latency"])),
        click.option("--disaggregation", default="auto", show_default=True,
                     type=click.Choice(["auto", "always", "never"])),
        click.option("--router-ttft-slo-s", default=0.0, show_default=True, type=float,
                     help="The router's TTFT SLO (admission); 0: none."),
        click.option("--router-tbt-slo-s", default=0.0, show_default=True, type=float),
        click.option("--max-candidates", default=max_candidates, show_default=True, type=int,
                     help="Least-loaded workers per role the policy scores (0: all)."),
        click.option("--slo-ttft-ms", default=2000.0, show_default=True, type=float, help="Goodput SLO (bench's)."),
        click.option("--slo-tbt-ms", default=200.0, show_default=True, type=float),
        click.option("--seed", default=0, show_default=True, type=int),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def choices(kw: dict, num_prefill: int, num_decode: int, tp: int) -> tuple[WorkloadChoice, ClusterChoice]:
    """The workload and cluster of the command line. Raises click.UsageError for a trace without
    a file (naming where to get it); a prompt set without one is the built-in prompts, with a note."""
    from core.datasets import data_dir

    path = workload_path(kw["kind"], kw["path"], data_dir(kw["data_folder"]), console.print)
    workload = WorkloadChoice(kw["kind"], path, kw["num_requests"], kw["time_scale"], kw["rate_per_s"],
                              kw["max_tokens"], kw["seed"])
    router = router_spec(kw["routing_policy"], kw["disaggregation"], kw["router_ttft_slo_s"], kw["router_tbt_slo_s"],
                         kw["max_candidates"])
    cluster = ClusterChoice(num_prefill, num_decode, kw["gpu"], kw["model"], tp, kw["cost_model"], kw["block_size"],
                            kw["num_kv_blocks"], kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"],
                            router, kw["pool_capacity_bytes"], kw["kv_cache_dtype"])
    return workload, cluster


def kv_line(kv: dict) -> str:
    """One line of :func:`sim.setup.kv_footprint`: what the KV cache dtype sets."""
    dtype = "auto (the model's dtype)" if kv["kv_cache_dtype"] == "auto" else kv["kv_cache_dtype"]
    pool = f"pool {kv['pool_capacity_blocks']:,} blocks"
    pool += (f" ({kv['pool_capacity_bytes'] / 2**40:.2f} TiB)" if kv["pool_capacity_bytes"]
             else " (no --pool-capacity-bytes)")
    return (f"KV {dtype}: {kv['kv_bytes_per_token']:,.0f} B per token, {kv['block_bytes'] / 2**20:.2f} MiB per "
            f"block; {kv['num_kv_blocks']:,} blocks per worker; {pool}; a mean prompt "
            f"({kv['mean_prompt_tokens']:,.0f} tokens) is {kv['mean_prompt_kv_bytes'] / 1e9:.2f} GB of KV, "
            f"{kv['mean_prompt_transfer_s'] * 1000:.1f} ms per hop on a worker's NIC")


def mean_prompt_tokens(requests) -> float:
    return sum(len(r.prompt) for r in requests) / len(requests) if requests else 0.0


@click.command()
@workload_options
@click.option("--num-prefill", default=1, show_default=True, type=int, help="Prefill workers (0: colocated).")
@click.option("--num-decode", default=1, show_default=True, type=int, help="Decode workers.")
@click.option("--tp", default=1, show_default=True, type=int, help="Tensor-parallel GPUs per worker.")
@click.option("--out", "out_dir", default=".cache/sim", show_default=True, type=click.Path(path_type=Path))
@click.option("--plots/--no-plots", default=True, show_default=True)
def sim(num_prefill: int, num_decode: int, tp: int, out_dir: Path, plots: bool, **kw) -> None:
    """Simulate a cluster on a workload with Tandem's own Scheduler and router (docs/sim.md)."""
    workload, cluster_choice = choices(kw, num_prefill, num_decode, tp)
    try:
        requests = load_requests(workload)
        cluster = build_cluster(cluster_choice)
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    kv = kv_footprint(cluster_choice, cluster.decode, mean_prompt_tokens(requests))
    console.print(kv_line(kv))
    started = time.perf_counter()
    result = Simulation(cluster).run(requests)
    wall_s = time.perf_counter() - started
    slo = SLO(kw["slo_ttft_ms"], kw["slo_tbt_ms"])
    workload_settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(workload).items()}
    settings = {"workload": workload_settings, "cluster": cluster.label, "gpu": kw["gpu"],
                "model": kw["model"], "tp": tp, "cost_model": str(kw["cost_model"] or ""), "kv": kv, "wall_s": wall_s}
    data = result_json(f"sim {cluster.label}", {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()},
                       result, slo)
    paths = save(data, out_dir, plots)
    console.print(summary_table({data["label"]: data["summary"]}, title="simulated"))
    util = data["sim"]["mean_utilisation"]
    console.print(f"{len(requests)} requests on {cluster.num_gpus} GPUs in {wall_s:.1f} s ({result.num_events} events); "
                  f"mean utilisation prefill {util['prefill']:.0%} decode {util['decode']:.0%}; pool hit rate "
                  f"{result.pool_hit_rate:.0%}; prefix-cache hit rate {result.prefix_cache_hit_rate:.0%}")
    for path in paths:
        console.print(f"wrote {path}")


def plan_options(f):
    return workload_options(f, block_size=128, max_candidates=4)


@click.command()
@plan_options
@click.option("--gpus", "gpu_counts", default="8,16,32,64,128", show_default=True,
              help="Fleet sizes to try (comma-separated GPU counts).")
@click.option("--tp", "tps", default="1", show_default=True, help="Tensor-parallel degrees to try (comma-separated).")
@click.option("--target", default=0.9, show_default=True, type=float, help="SLO attainment a configuration must reach.")
@click.option("--out", "out_dir", default=".cache/plan", show_default=True, type=click.Path(path_type=Path))
@click.option("--helm-values", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the recommendation as Helm values overrides (validated against the chart's schema).")
@click.option("--jobs", default=os.cpu_count() or 1, show_default=True, type=int, help="Simulations at once.")
@click.option("--all-sizes", is_flag=True, help="Evaluate every size, not only those a bisection visits.")
def plan(gpu_counts: str, tps: str, target: float, out_dir: Path, helm_values: Path | None, jobs: int,
         all_sizes: bool, **kw) -> None:
    """Search P:D ratios (and TP) per fleet size with the simulator; recommend the smallest fleet
    meeting the SLO attainment target, beside the colocated baseline (docs/sim.md)."""
    from bench.report import save_json
    from sim import plan as planner

    if not 0 < target <= 1:
        raise click.BadParameter(f"--target must be in (0, 1], got {target}")
    try:
        counts = sorted({int(x) for x in gpu_counts.split(",")})
        tp_list = sorted({int(x) for x in tps.split(",")})
    except ValueError:
        raise click.BadParameter(f"--gpus and --tp take comma-separated integers, got {gpu_counts!r}, {tps!r}") from None
    workload, base = choices(kw, 1, 1, tp_list[0])
    slo = SLO(kw["slo_ttft_ms"], kw["slo_tbt_ms"])
    started = time.perf_counter()
    try:
        requests = load_requests(workload)
        kv = kv_footprint(base, build_worker(base, tp_list[0]), mean_prompt_tokens(requests))
        console.print(kv_line(kv))
        points = planner.search(requests, base, counts, tp_list, slo, target, jobs=jobs, all_sizes=all_sizes,
                                progress=lambda p: console.print(
                                    f"  {p.num_gpus:4d} GPUs {p.label:28s} goodput "
                                    f"{planner.bound(f'{p.goodput_rps:.2f}', p.aborted):>8s} req/s, attainment "
                                    f"{planner.bound(f'{p.slo_attainment:.0%}', p.aborted)}"
                                    f"{' (stopped early: lower bounds)' if p.aborted else ''}, {p.cpu_s:.0f} CPU-s"))
    except ValueError as err:
        raise click.BadParameter(str(err)) from None
    wall_s = time.perf_counter() - started
    cpu_s = sum(p.cpu_s for p in points)  # the simulations' own, across the --jobs processes
    console.print(_plan_table(points, len(requests), slo, target, kv["kv_cache_dtype"]))
    skipped = planner.not_evaluated(counts, tp_list, points, target)
    if skipped is not None:
        console.print(skipped, soft_wrap=True)
    best = planner.recommend(points, target)
    out = {"settings": {"gpus": counts, "tp": tp_list, "target": target, "slo": dataclasses.asdict(slo),
                        "gpu": kw["gpu"], "model": kw["model"], "kv": kv, "wall_s": wall_s, "cpu_s": cpu_s},
           "points": planner.as_rows(points), "recommendation": planner.as_rows([best])[0] if best else None}
    save_json(out, out_dir / "plan.json")
    planner.plot(points, out_dir / "goodput_vs_gpus.png", f"{kw['model']} on {kw['gpu']}, KV {kw['kv_cache_dtype']}")
    if best is None:
        console.print(f"no configuration reaches {target:.0%} SLO attainment; try more GPUs or a looser SLO "
                      f"({wall_s:.0f} s, {cpu_s:.0f} CPU-s in {len(points)} simulations)")
        return
    console.print(f"recommendation: {best.label} on {best.num_gpus} GPUs, goodput {best.goodput_rps:.2f} req/s, "
                  f"attainment {best.slo_attainment:.0%} (searched in {wall_s:.0f} s, {cpu_s:.0f} CPU-s in {len(points)} "
                  f"simulations)")
    tie = planner.ties(points, best, target)
    if tie is not None:
        console.print(f"a tie: {tie.label} on the same GPUs reaches {tie.goodput_rps:.2f} req/s (attainment "
                      f"{tie.slo_attainment:.0%}), within the simulator's error ({planner.SIM_ERROR:.0%}, docs/sim.md): "
                      "either serves this load; measure both before choosing")
        out["tie"] = planner.as_rows([tie])[0]
        save_json(out, out_dir / "plan.json")
    if helm_values is not None:
        _write_helm_values(helm_values, best, base, slo)


def _plan_table(points, num_requests: int, slo: SLO, target: float, kv_cache_dtype: str):
    """Best disaggregated vs colocated configuration per fleet size, and their goodput ratio."""
    from rich.table import Table

    from sim import plan as planner

    table = Table("GPUs", "best disaggregated", "goodput req/s", "attainment", "colocated goodput", "attainment",
                  "disagg / colocated", title=f"plan: {num_requests} requests, KV {kv_cache_dtype}, SLO TTFT "
                                                  f"{slo.ttft_ms:g} ms, TBT {slo.tbt_ms:g} ms, target {target:.0%}")
    disagg, coloc = planner.best_per_size(points, False), planner.best_per_size(points, True)
    for n in sorted(set(disagg) | set(coloc)):
        d, c = disagg.get(n), coloc.get(n)

        def cells(p):
            if p is None:
                return "-", "-"
            return (planner.bound(f"{p.goodput_rps:.2f}", p.aborted), planner.bound(f"{p.slo_attainment:.0%}", p.aborted))

        table.add_row(str(n), d.label if d else "-", *cells(d), *cells(c), planner.ratio_text(d, c))
    if any(p.aborted for p in points):
        table.caption = (">= : the run stopped early once it could no longer reach the target; its goodput and "
                         "attainment are lower bounds (and a ratio over it one too)")
    return table


def _write_helm_values(path: Path, best, base, slo: SLO) -> None:
    """The recommendation as chart values overrides, validated against the chart's schema."""
    import yaml

    from sim import plan as planner

    worker = build_worker(base, best.tp)
    overrides = planner.helm_values(best, base, worker.engine.num_kv_blocks, worker.engine.max_model_len, slo)
    planner.validate_values(overrides, Path(__file__).parents[1] / "deploy/k8s/helm/tandem")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(overrides, sort_keys=False))
    console.print(f"wrote {path} (helm install -f {path})")
