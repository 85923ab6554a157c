"""``tandem sim`` and ``tandem plan``."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import click
from rich.console import Console

from bench.metrics import SLO
from bench.report import summary_table
from bench.workloads import PROMPT_SET_KINDS, TRACE_KINDS
from sim.hardware import GPUS, MODELS
from sim.output import result_json, save
from sim.setup import ClusterChoice, WorkloadChoice, build_cluster, load_requests, router_spec
from sim.simulator import Simulation

console = Console(width=None if sys.stdout.isatty() else 200)


def workload_options(f):
    options = [
        click.option("--workload", "kind", default="mooncake", show_default=True,
                     type=click.Choice(TRACE_KINDS + PROMPT_SET_KINDS)),
        click.option("--path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="Trace or prompt file (traces: required)."),
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
        click.option("--block-size", default=16, show_default=True, type=int),
        click.option("--num-kv-blocks", default=0, show_default=True, type=int, help="0: what fits the GPU."),
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
        click.option("--max-candidates", default=8, show_default=True, type=int,
                     help="Least-loaded workers per role the policy scores (0: all)."),
        click.option("--slo-ttft-ms", default=2000.0, show_default=True, type=float, help="Goodput SLO (bench's)."),
        click.option("--slo-tbt-ms", default=200.0, show_default=True, type=float),
        click.option("--seed", default=0, show_default=True, type=int),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def choices(kw: dict, num_prefill: int, num_decode: int, tp: int) -> tuple[WorkloadChoice, ClusterChoice]:
    workload = WorkloadChoice(kw["kind"], kw["path"], kw["num_requests"], kw["time_scale"], kw["rate_per_s"],
                              kw["max_tokens"], kw["seed"])
    router = router_spec(kw["routing_policy"], kw["disaggregation"], kw["router_ttft_slo_s"], kw["router_tbt_slo_s"],
                         kw["max_candidates"])
    cluster = ClusterChoice(num_prefill, num_decode, kw["gpu"], kw["model"], tp, kw["cost_model"], kw["block_size"],
                            kw["num_kv_blocks"], kw["max_num_seqs"], kw["max_num_batched_tokens"], kw["max_model_len"],
                            router)
    return workload, cluster


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
    started = time.perf_counter()
    result = Simulation(cluster).run(requests)
    wall_s = time.perf_counter() - started
    slo = SLO(kw["slo_ttft_ms"], kw["slo_tbt_ms"])
    workload_settings = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(workload).items()}
    settings = {"workload": workload_settings, "cluster": cluster.label, "gpu": kw["gpu"],
                "model": kw["model"], "tp": tp, "cost_model": str(kw["cost_model"] or ""), "wall_s": wall_s}
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
