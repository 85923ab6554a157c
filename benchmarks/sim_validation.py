"""Simulated vs measured: TTFT and TBT p50/p90 of `tandem bench` and `tandem sim` on the same workload.

    .venv/bin/python benchmarks/sim_validation.py                 # all four configurations
    .venv/bin/python benchmarks/sim_validation.py --configs colocated-1 --num-requests 24

For each configuration (colocated 1 worker, 1P+1D, colocated 2 workers, 2P+2D): start a local
cluster of the bundled model, wait for every worker's start-up calibration, replay the workload
(Mooncake conversation rows at 1/32 length, Poisson arrivals at a low rate, ``ignore_eos``)
through the bench client, read the cost model each worker fitted of itself on this machine from
the registry (``cost_*`` heartbeat fields, with the measured pool bandwidth), stop the cluster,
then simulate the same request token ids at the same send times on workers timed by those cost
models (their real Scheduler, the real router policy). Prints one row per configuration with the
relative error of each percentile (target: within 15 %) and writes the JSON to --out.

Takes about 2-3 minutes per configuration on a quiet 2-core machine (cluster start-up and
calibration ~40 s, the replay ~60-90 s, the simulation < 1 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.arrivals import ArrivalConfig, send_times_s  # noqa: E402
from bench.client import ClientConfig  # noqa: E402
from bench.metrics import SLO, summarize  # noqa: E402
from bench.runner import run  # noqa: E402
from bench.synthesis import PrefixSynthesizer, SynthesisConfig  # noqa: E402
from bench.traces import read_mooncake  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from core.cost_model import CostModel  # noqa: E402
from core.worker_load import WorkerLoad  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from launcher.local_cluster import ClusterConfig, LocalCluster, free_port  # noqa: E402
from sim.cluster import ClusterSpec, RouterSpec, fitted_worker  # noqa: E402
from sim.simulator import Simulation  # noqa: E402
from sim.workload import SimRequest  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_fast25_conversation_trace.jsonl"
FALLBACK_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_conversation_slice.jsonl"
CONFIGS = {"colocated-1": (0, 1), "1P+1D": (1, 1), "colocated-2": (0, 2), "2P+2D": (2, 2)}
ENGINE = dict(block_size=16, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
TARGET_ERROR = 0.15


def workload(args) -> list[BenchRequest]:
    synthesis = SynthesisConfig(length_scale=1 / 32, output_scale=1 / 32)
    synthesizer = PrefixSynthesizer(synthesis)
    requests = []
    for index, row in enumerate(read_mooncake(args.trace)):
        if len(requests) >= args.num_requests:
            break
        output = min(args.max_output_tokens, max(4, synthesis.scale_output(row.output_tokens)))
        prompt = synthesizer.prompt(row, index)
        if len(prompt) + output < ENGINE["max_model_len"] - 16:
            requests.append(BenchRequest(prompt, output, row.arrival_s, len(prompt)))
    return requests


def worker_loads(redis_url: str) -> dict[str, list[dict]]:
    """role -> the load dicts of that role's registered workers."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = client.keys("tandem:workers:*")
        loads: dict[str, list[dict]] = {"prefill": [], "decode": []}
        for value in client.mget(keys) if keys else []:
            info = json.loads(value) if value else None
            if info and info["role"] in loads:
                loads[info["role"]].append(info["load"])
        return loads
    finally:
        client.close()


def wait_for_cost_models(redis_url: str, num_workers: int, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(1 for ls in worker_loads(redis_url).values() for load in ls if load.get("cost_num_samples")) < num_workers:
        if time.monotonic() > deadline:
            raise RuntimeError(f"workers published no cost model within {timeout_s:.0f} s")
        time.sleep(0.5)


def role_model(loads: list[dict]) -> CostModel:
    """One cost model per role: the median of each coefficient over the role's workers."""
    models = [m for m in (WorkerLoad.from_wire(load).fitted_cost_model for load in loads) if m is not None]
    med = lambda name: statistics.median(getattr(m, name) for m in models)  # noqa: E731
    return CostModel(med("base_s"), med("per_token_s"), med("per_seq_s"), med("per_attn_s"), len(models),
                     ENGINE["max_num_batched_tokens"], med("kv_load_bytes_per_s"), med("kv_bytes_per_token"))


def measure(name: str, requests: list[BenchRequest], arrivals: ArrivalConfig, args) -> tuple[dict, dict]:
    num_prefill, num_decode = CONFIGS[name]
    config = ClusterConfig(model=MODEL, http_port=free_port(), grpc_port=free_port(), num_threads=args.num_threads,
                           colocated=num_prefill == 0, num_prefill_workers=max(1, num_prefill),
                           num_decode_workers=num_decode, log_dir=args.log_dir / name,
                           extra_worker_args=("--log-level", args.worker_log_level), **ENGINE)
    with LocalCluster(config) as cluster:
        cluster.start()
        wait_for_cost_models(cluster.redis_url, num_prefill + num_decode)
        client = ClientConfig(url=cluster.http_url, model=MODEL, ignore_eos=True, timeout_s=600)
        result = asyncio.run(run(requests, arrivals, client, show_progress=False, label=name))
        loads = worker_loads(cluster.redis_url)  # the fits after the run: calibration + the run's steps
    return summarize(result.records, result.duration_s, SLO()), loads


def simulate(name: str, requests: list[BenchRequest], arrivals: ArrivalConfig, loads: dict) -> dict:
    num_prefill, num_decode = CONFIGS[name]
    engine = EngineConfig(**ENGINE)
    decode_cost = role_model(loads["decode"])
    prefill_cost = role_model(loads["prefill"]) if num_prefill else decode_cost
    decode = fitted_worker(decode_cost, engine, decode_cost.kv_bytes_per_token)
    prefill = fitted_worker(prefill_cost, engine, prefill_cost.kv_bytes_per_token)
    times = send_times_s(arrivals, [r.arrival_s for r in requests])
    sim_requests = [SimRequest(r.prompt, r.max_tokens, t) for r, t in zip(requests, times)]
    result = Simulation(ClusterSpec(num_prefill, num_decode, prefill, decode, router=RouterSpec())).run(sim_requests)
    return summarize(result.records, result.duration_s, SLO())


def errors(measured: dict, simulated: dict) -> dict:
    out = {}
    for metric in ("ttft_ms", "tbt_ms"):
        for q in ("p50", "p90"):
            m, s = measured[metric][q], simulated[metric][q]
            out[f"{metric}_{q}"] = {"measured": m, "simulated": s, "error": (s - m) / m if m else float("nan")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {list(CONFIGS)}")
    parser.add_argument("--trace", type=Path, default=TRACE if TRACE.exists() else FALLBACK_TRACE)
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second (low: the 2-core machine)")
    parser.add_argument("--num-threads", type=int, default=2, help="CPU threads shared by the workers")
    parser.add_argument("--log-dir", type=Path, default=Path(".cache/logs/sim-validation"))
    parser.add_argument("--worker-log-level", default="INFO", help="DEBUG logs every pass's timing (engine.engine)")
    parser.add_argument("--out", type=Path, default=Path(".cache/sim-validation.json"))
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; expected some of {list(CONFIGS)}")
    requests = workload(args)
    arrivals = ArrivalConfig("poisson", rate_per_s=args.rate, seed=0)
    rows = {}
    print("| config | TTFT p50 meas/sim (err) | TTFT p90 meas/sim (err) | TBT p50 meas/sim (err) | TBT p90 meas/sim (err) |")
    print("|---|---|---|---|---|")
    for name in names:
        started = time.monotonic()
        measured, loads = measure(name, requests, arrivals, args)
        simulated = simulate(name, requests, arrivals, loads)
        rows[name] = {"errors": errors(measured, simulated), "measured": measured, "simulated": simulated,
                      "cost_models": {role: [{k: v for k, v in load.items() if k.startswith("cost_")} for load in ls]
                                      for role, ls in loads.items()}, "wall_s": time.monotonic() - started}
        cells = [f"{e['measured']:.0f}/{e['simulated']:.0f} ({e['error']:+.0%})" for e in rows[name]["errors"].values()]
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    worst = max(abs(e["error"]) for r in rows.values() for e in r["errors"].values())
    print(f"worst error {worst:.0%} (target {TARGET_ERROR:.0%}); {len(requests)} requests at {args.rate} req/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
