"""Simulated vs measured: TTFT and TBT p50/p90 of `tandem bench` and `tandem sim` on the same workload.

    .venv/bin/python benchmarks/sim_validation.py                 # all four configurations, ~10 min
    .venv/bin/python benchmarks/sim_validation.py --configs colocated-1,1P+1D

For each configuration (colocated 1 worker, 1P+1D, colocated 2 workers, 2P+2D): start a local
cluster of the bundled model and wait for every worker's start-up calibration; time the router's
own per-request overhead with a few short sequential probe requests (their client TTFT minus the
first pass the workers' fitted cost models predict); replay the workload (Mooncake conversation
rows at 1/32 length, Poisson arrivals at a low rate, ``ignore_eos``) through the bench client;
read the cost model each worker fitted of itself (``cost_*`` heartbeat fields: calibration plus
the live passes, each timed as the whole pass, with the measured pool bandwidth); stop the
cluster; then simulate the same request token ids at the same send times on workers timed by
the fits of their uncontended passes, each step drawn around its fit from the measured passes
nearest to it (sim.adapter.JitteredTimer), the router (the real policy) reading the fits each
real worker published as the replay went (recomputed from its pass log), with the measured
router overhead and the cores shared as the launcher splits them (sim.cluster.CoreSharing, each
role's measured exponent), 20 seeds. Nothing of the replay's TTFT or TBT goes into the
simulation.

Prints one row per configuration with the relative error of each percentile (target: within
15 %), the same for variants without each modelled term (what each one is worth), the load
average around each run, and the per-pass analysis of the workers' DEBUG logs
(benchmarks/step_timeline.py: host share of a pass, the measured slowdown of passes that ran
beside another worker's); writes all of it as JSON to --out.

About 4 minutes per configuration on a quiet 2-core machine (cluster start-up and calibration
~30-50 s, the replay ~215 s of 64 requests at 0.3 req/s, the simulations a few seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
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
from benchmarks.step_timeline import (  # noqa: E402
    analyze_dir, before_replay, published_schedules, quantiles, read_passes, worker_logs)
from core.cost_model import CostModel, prefill_attn_pairs  # noqa: E402
from core.datasets import data_file  # noqa: E402
from core.worker_load import WorkerLoad  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from launcher.commands import worker_threads  # noqa: E402
from launcher.config import ClusterConfig  # noqa: E402
from launcher.local_cluster import LocalCluster  # noqa: E402
from launcher.ports import free_port  # noqa: E402
from sim.adapter import JitteredTimer  # noqa: E402
from sim.cluster import ClusterSpec, CoreSharing, RouterSpec, fitted_worker  # noqa: E402
from sim.simulator import Simulation  # noqa: E402
from sim.workload import SimRequest  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TRACE = data_file("mooncake")  # the data folder's Mooncake trace (docs/data.md)
FALLBACK_TRACE = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_conversation_slice.jsonl"
CONFIGS = {"colocated-1": (0, 1), "1P+1D": (1, 1), "colocated-2": (0, 2), "2P+2D": (2, 2)}
ENGINE = dict(block_size=16, num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048)
TARGET_ERROR = 0.15
PROBE_PROMPT_TOKENS = 16


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


@dataclasses.dataclass
class Measured:
    summary: dict  # bench.metrics.summarize of the replay
    calibration_loads: dict  # role -> load dicts, read before the replay (start-up calibration only)
    loads: dict  # role -> load dicts, read after it (calibration + the replay's passes)
    request_overhead_s: float  # the router's per-request time, from the probes
    probe_ttfts_s: list[float]
    load_average: tuple  # os.getloadavg() before and after the replay
    since_s: float  # wall clock at the replay's start (the step logs' passes after it)


def probe_requests(num: int, seed: int) -> list[BenchRequest]:
    """Short prompts of random ids (no prefix shared with each other or the workload)."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randrange(1000, 40000) for _ in range(PROBE_PROMPT_TOKENS)], 2, None, PROBE_PROMPT_TOKENS)
            for _ in range(num)]


def request_overhead_s(ttfts_s: list[float], passes: list[tuple[str, float]], models: dict[str, CostModel]) -> float:
    """The router's own time per request: the probes' median client TTFT minus the time the worker
    that computed the first token spent on it (plus the KV store to the pool on a prefill worker).
    ``passes``: (role, seconds) of each probe's pass as that worker logged it, in probe order;
    without them (other log levels), the pass the first role's fitted cost model predicts (the
    prefill worker's where there is one). Never negative."""
    if len(passes) != len(ttfts_s):
        role = "prefill" if "prefill" in models else "decode"
        pass_s = models[role].step_s(PROBE_PROMPT_TOKENS, 1, prefill_attn_pairs(PROBE_PROMPT_TOKENS, 0))
        passes = [(role, pass_s)] * len(ttfts_s)
    worker_s = [s + (models[r].kv_load_s(PROBE_PROMPT_TOKENS) if r == "prefill" else 0.0) for r, s in passes]
    return max(0.0, statistics.median(t - w for t, w in zip(ttfts_s, worker_s)))


def probe_passes(log_dir: Path, since_s: float, until_s: float) -> list[tuple[str, float]]:
    """(role, seconds) of the probe prompts' passes (PROBE_PROMPT_TOKENS tokens, one sequence)
    that any worker logged between ``since_s`` and ``until_s`` (wall clock), in time order: the
    router may prefill a short prompt on the decode worker (conditional disaggregation)."""
    logs = worker_logs(log_dir)
    passes = [p for log in logs for p in read_passes(log, since_s)
              if p.end_s <= until_s and (p.sample.num_new_tokens, p.sample.num_seqs) == (PROBE_PROMPT_TOKENS, 1)]
    return [(p.worker.split("-")[0], p.sample.duration_s) for p in sorted(passes, key=lambda p: p.end_s)]


def measure(name: str, requests: list[BenchRequest], arrivals: ArrivalConfig, args) -> Measured:
    num_prefill, num_decode = CONFIGS[name]
    config = ClusterConfig.from_options(model=MODEL, http_port=free_port(), grpc_port=free_port(),
                                        num_threads=args.num_threads, colocated=num_prefill == 0,
                                        num_prefill_workers=max(1, num_prefill), num_decode_workers=num_decode,
                                        # each role on its own cores, as sim.cluster.CoreSharing models it
                                        # (a decode worker borrowing idle prefill cores is not simulated)
                                        share_cores=False, log_dir=args.log_dir / name, **ENGINE)
    config = dataclasses.replace(config, worker=dataclasses.replace(config.worker, log_level=args.worker_log_level))
    with LocalCluster(config) as cluster:
        cluster.start()
        wait_for_cost_models(cluster.redis_url, num_prefill + num_decode)
        calibration_loads = worker_loads(cluster.redis_url)  # start-up calibration only
        client = ClientConfig(url=cluster.http_url, model=MODEL, ignore_eos=True, timeout_s=600)
        probe_started_s = time.time()
        probes = asyncio.run(run(probe_requests(args.num_probes, seed=len(name)), ArrivalConfig("concurrency", concurrency=1),
                                 client, show_progress=False, label="probe"))
        ttfts = [r.ttft_s for r in sorted(probes.records, key=lambda r: r.start_s) if r.ok and r.ttft_s is not None]
        before, since_s = os.getloadavg(), time.time()
        result = asyncio.run(run(requests, arrivals, client, show_progress=False, label=name))
        after = os.getloadavg()
        loads = worker_loads(cluster.redis_url)  # the fits after the run: calibration + the run's passes
    models = {role: role_model(ls) for role, ls in loads.items() if ls}
    overhead_s = request_overhead_s(ttfts, probe_passes(args.log_dir / name, probe_started_s, since_s), models)
    return Measured(summarize(result.records, result.duration_s, SLO()), calibration_loads, loads, overhead_s, ttfts,
                    (before, after), since_s)


def sharing_of(name: str, num_threads: int) -> CoreSharing:
    """How the launcher splits this machine's cores between the configuration's workers."""
    num_prefill, num_decode = CONFIGS[name]
    cores = num_threads or os.cpu_count() or 2
    threads = worker_threads(cores, num_prefill == 0, max(1, num_prefill), num_decode)
    return CoreSharing(cores, threads.get("prefill", 1), threads["decode"])


def role_models(loads: dict) -> dict[str, CostModel]:
    """role -> role_model of the workers' published fits (a colocated cluster's prefill: decode's)."""
    decode = role_model(loads["decode"])
    return {"prefill": role_model(loads["prefill"]) if loads["prefill"] else decode, "decode": decode}


def uncontended_models(published: dict[str, CostModel], timeline: dict, median_scaled: bool = True) -> dict[str, CostModel]:
    """The role models refitted on each worker's uncontended passes (step_timeline: those that
    ran while the busy threads fitted the cores; the workers' own timings), the median over the
    role's workers, with the published budget and pool bandwidth. A worker's published fit mixes
    passes slowed by its neighbours with the rest, which CoreSharing would count a second time.

    ``median_scaled``: each fit is scaled by the median of its passes' time over its prediction.
    The fit minimises the mean *relative* error, which for right-skewed step times (a pass now and
    then 2-6x slower) is a median weighted towards the short passes: it sits below the typical
    pass (its passes' median was 1.1-1.5x it here), and the simulator would run that much fast."""
    models = {}
    for role, cost in published.items():
        rows = [t for w, t in timeline.items() if w.split("-")[0] == role]
        if not rows:
            models[role] = models.get("decode", cost) if role == "prefill" else cost
            continue
        scale = lambda t: t["fitted_pass_over_fit_p10_p50_p90"][1] if median_scaled else 1.0  # noqa: E731
        med = lambda key, unit: statistics.median(t["fit_on_alone_passes"][key] * scale(t) for t in rows) / unit  # noqa: E731
        models[role] = dataclasses.replace(cost, base_s=med("base_ms", 1e3), per_token_s=med("per_token_us", 1e6),
                                           per_seq_s=med("per_seq_us", 1e6), per_attn_s=med("per_attn_us", 1e6))
    return models


def worker_exponents(timeline: dict) -> dict[str, float]:
    """worker -> log(measured slowdown) / log(processor sharing's slowdown) of its contended
    passes (step_timeline), in [0, 4], for the workers that had any."""
    return {w: min(4.0, max(0.0, math.log(max(t["measured_slowdown_p50"], 1.0)) / math.log(t["modelled_slowdown_p50"])))
            for w, t in timeline.items() if t.get("modelled_slowdown_p50", 1.0) > 1.05 and "measured_slowdown_p50" in t}


def measured_exponent(timeline: dict) -> float:
    """CoreSharing.exponent from the pass logs: the median of :func:`worker_exponents` over the
    workers with contended passes; 1 (processor sharing) when no pass was contended."""
    exponents = list(worker_exponents(timeline).values())
    return statistics.median(exponents) if exponents else 1.0


def measured_sharing(sharing: CoreSharing, timeline: dict) -> CoreSharing:
    """``sharing`` with the measured exponent, and each role's own (the median over its workers)
    where its workers had contended passes: a 2-thread decode worker beside a 1-thread prefill
    worker need not lose what the prefill worker loses."""
    by_role: dict[str, list[float]] = {}
    for worker, exponent in worker_exponents(timeline).items():
        by_role.setdefault(worker.split("-")[0], []).append(exponent)
    role = lambda r: statistics.median(by_role[r]) if r in by_role else None  # noqa: E731
    return dataclasses.replace(sharing, exponent=measured_exponent(timeline), prefill_exponent=role("prefill"),
                               decode_exponent=role("decode"))


def jitter_ratios(timeline: dict) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """role -> step kind -> (size, pass / fit ratio) of the role's workers' uncontended passes
    (step_timeline's ``pass_over_fit``), for sim.adapter.JitteredTimer; a colocated cluster's
    prefill role is its decode workers'."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for worker, row in timeline.items():
        kinds = out.setdefault(worker.split("-")[0], {})
        for kind, pairs in row.get("pass_over_fit", {}).items():
            kinds.setdefault(kind, []).extend((int(size), ratio) for size, ratio in pairs)
    if "prefill" not in out and "decode" in out:
        out["prefill"] = out["decode"]
    return out


PERCENTILES = [(metric, q) for metric in ("ttft_ms", "tbt_ms", "e2e_ms") for q in ("p50", "p90", "p99")]


def simulate(name: str, requests: list[BenchRequest], arrivals: ArrivalConfig, models: dict[str, CostModel],
             overhead_s: float, sharing: CoreSharing | None, jitter: dict | None = None, num_seeds: int = 1,
             router_models: dict[str, CostModel] | None = None, calibration: dict | None = None,
             schedules: dict | None = None) -> dict:
    """bench.metrics.summarize of the simulated replay: steps timed by ``models``. The router
    reads in the workers' heartbeats: with ``calibration`` (role -> the StepSamples a real worker
    of it ran before the replay), each simulated worker's live fit of its own steps seeded with
    them (sim.cluster.WorkerSpec.live_fit, as a real worker publishes); with ``schedules`` (role ->
    :func:`published_schedules`), the fits the real workers published as the replay went; else ``router_models``
    (None: ``models``) throughout. With ``jitter`` (:func:`jitter_ratios`),
    each role's steps are drawn around its fit (sim.adapter.JitteredTimer) in ``num_seeds``
    simulations: each TTFT / TBT / E2E percentile is then the median over the seeds, and
    ``seeds`` holds every seed's value (the spread one measured run is a draw of)."""
    num_prefill, num_decode = CONFIGS[name]
    engine = EngineConfig(**ENGINE)
    times = send_times_s(arrivals, [r.arrival_s for r in requests])
    sim_requests = [SimRequest(r.prompt, r.max_tokens, t) for r, t in zip(requests, times)]
    router = RouterSpec(request_overhead_s=overhead_s)
    summaries = []
    for seed in range(num_seeds if jitter else 1):
        workers = {}
        for role, cost in models.items():
            worker = fitted_worker(cost, engine, cost.kv_bytes_per_token)
            if jitter and jitter.get(role):
                worker = dataclasses.replace(worker, timer=JitteredTimer(worker.timer, jitter[role], seed=seed))
            if router_models:
                worker = dataclasses.replace(worker, cost=router_models[role])
            if calibration is not None:
                worker = dataclasses.replace(worker, live_fit=True, calibration=tuple(calibration.get(role, ())))
            if schedules and schedules.get(role):
                worker = dataclasses.replace(worker, cost_schedules=schedules[role])
            workers[role] = worker
        spec = ClusterSpec(num_prefill, num_decode, workers["prefill"], workers["decode"], router=router, sharing=sharing)
        result = Simulation(spec).run(sim_requests)
        summaries.append(summarize(result.records, result.duration_s, SLO()))
    if len(summaries) == 1:
        return summaries[0]
    summary = dict(summaries[0], seeds={f"{m}_{q}": [s[m][q] for s in summaries] for m, q in PERCENTILES})
    for metric, q in PERCENTILES:
        summary[metric] = dict(summary[metric], **{q: statistics.median(s[metric][q] for s in summaries)})
    return summary


def errors(measured: dict, simulated: dict) -> dict:
    out = {}
    for metric in ("ttft_ms", "tbt_ms"):
        for q in ("p50", "p90"):
            m, s = measured[metric][q], simulated[metric][q]
            out[f"{metric}_{q}"] = cell = {"measured": m, "simulated": s, "error": (s - m) / m if m else float("nan")}
            seeds = simulated.get("seeds", {}).get(f"{metric}_{q}")
            if seeds and m:  # the p10 and p90 over the seeds, as errors
                cell["seed_band"] = [(v - m) / m for v in quantiles(seeds, (0.1, 0.9))]
    return out


def stored_measurement(result: dict, log_dir: Path) -> Measured:
    """A Measured back from a result this script wrote (--resimulate): the replay's summary, the
    workers' published fits, the router overhead; the passes come from ``log_dir`` again."""
    wire = lambda ls: {role: [dict(load) for load in loads] for role, loads in ls.items()}  # noqa: E731
    since_s = result.get("since_s") or min(
        (json.loads(line)["ts"] for log in log_dir.glob("*.log") for line in log.read_text().splitlines()
         if '"serving ' in line), default=0.0)
    return Measured(result["measured"], wire(result["calibration_cost_models"]), wire(result["cost_models"]),
                    result["request_overhead_ms"] / 1e3, [t / 1e3 for t in result.get("probe_ttft_ms", [])],
                    tuple(result.get("load_average_before_after", ())), since_s)


def validate(name: str, requests: list[BenchRequest], arrivals: ArrivalConfig, args, stored: dict | None = None) -> dict:
    """Measures one configuration (or takes ``stored``, a result of an earlier run), then
    simulates it with every modelled term and without each."""
    started = time.monotonic()
    m = measure(name, requests, arrivals, args) if stored is None else stored_measurement(stored, args.log_dir / name)
    sharing = sharing_of(name, args.num_threads)
    threads = {"prefill": sharing.prefill_threads, "decode": sharing.decode_threads}
    timeline = analyze_dir(args.log_dir / name, m.since_s, threads, sharing.num_cores)
    published = role_models(m.loads)
    # The jittered steps draw pass / fit ratios of the unscaled fits (their median is in them).
    fitted = uncontended_models(published, timeline, median_scaled=False)  # = published without DEBUG pass logs
    scaled = uncontended_models(published, timeline)
    jitter = jitter_ratios(timeline) or None
    processor_sharing, sharing = sharing, measured_sharing(sharing, timeline)
    one_exponent = dataclasses.replace(sharing, prefill_exponent=None, decode_exponent=None)
    # The router places by the fits the workers published (what the real router read in their
    # heartbeats), whatever times the simulated steps.
    overhead, n, seen = m.request_overhead_s, args.num_seeds, published
    live = before_replay(args.log_dir / name, m.since_s)
    replayed = published_schedules(args.log_dir / name, m.since_s, published)
    variants = {
        "simulated": (fitted, overhead, sharing, jitter, n, None, None, replayed),
        "router reads the simulated workers' live fits": (fitted, overhead, sharing, jitter, n, None, live),
        "router reads the final published fits": (fitted, overhead, sharing, jitter, n, seen),
        "router reads the simulated fits": (fitted, overhead, sharing, jitter, n),
        "no step-time jitter (median-scaled fits)": (scaled, overhead, sharing, None, 1, None, None, replayed),
        "one core-sharing exponent": (fitted, overhead, one_exponent, jitter, n, None, None, replayed),
        "processor sharing (exponent 1)": (fitted, overhead, processor_sharing, jitter, n, None, None, replayed),
        "published fits": (published, overhead, one_exponent),
        "published fits, no core sharing": (published, overhead, None),
        "calibration fits only": (role_models(m.calibration_loads), overhead, one_exponent),
        "no core sharing": (fitted, overhead, None, jitter, n, None, None, replayed),
        "no router overhead": (fitted, 0.0, sharing, jitter, n, None, None, replayed),
    }
    sims = {label: simulate(name, requests, arrivals, *v) for label, v in variants.items()}
    cost = lambda ls: {role: [{k: v for k, v in load.items() if k.startswith("cost_")} for load in loads]  # noqa: E731
                       for role, loads in ls.items()}
    return {"errors": {label: errors(m.summary, s) for label, s in sims.items()},
            "measured": m.summary, "simulated": sims["simulated"], "variants": sims,
            "request_overhead_ms": m.request_overhead_s * 1e3, "probe_ttft_ms": [t * 1e3 for t in m.probe_ttfts_s],
            "core_sharing": dataclasses.asdict(sharing), "load_average_before_after": m.load_average,
            "cost_models": cost(m.loads), "calibration_cost_models": cost(m.calibration_loads),
            "simulated_cost_models": {role: dataclasses.asdict(c) for role, c in fitted.items()}, "since_s": m.since_s,
            "step_timeline": timeline, "wall_s": stored["wall_s"] if stored else time.monotonic() - started}


def row(name: str, errs: dict) -> str:
    band = lambda e: f" [{e['seed_band'][0]:+.0%}..{e['seed_band'][1]:+.0%}]" if "seed_band" in e else ""  # noqa: E731
    cells = [f"{e['measured']:.0f} / {e['simulated']:.0f} ({e['error']:+.0%}){band(e)}" for e in errs.values()]
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated of {list(CONFIGS)}")
    parser.add_argument("--trace", type=Path, default=TRACE if TRACE.exists() else FALLBACK_TRACE)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-output-tokens", type=int, default=24)
    parser.add_argument("--rate", type=float, default=0.3, help="Poisson arrivals per second (low: the 2-core machine)")
    parser.add_argument("--num-probes", type=int, default=5, help="sequential short requests timing the router")
    parser.add_argument("--num-seeds", type=int, default=20,
                        help="simulations per variant with jittered steps (the median of each percentile is reported)")
    parser.add_argument("--num-threads", type=int, default=0, help="CPU threads shared by the workers (0: all cores)")
    parser.add_argument("--worker-log-level", default="DEBUG", help="DEBUG: the workers log every pass (step_timeline)")
    parser.add_argument("--log-dir", type=Path, default=Path(".cache/logs/sim-validation"))
    parser.add_argument("--out", type=Path, default=Path(".cache/sim-validation.json"))
    parser.add_argument("--resimulate", type=Path, help="a JSON this script wrote: simulate its measurements again "
                                                        "(with the same --log-dir and workload flags), start no cluster")
    args = parser.parse_args()
    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; expected some of {list(CONFIGS)}")
    requests = workload(args)
    arrivals = ArrivalConfig("poisson", rate_per_s=args.rate, seed=0)
    stored = json.loads(args.resimulate.read_text())["results"] if args.resimulate else {}
    rows = {}
    for name in names:
        if args.resimulate and name not in stored:
            continue
        rows[name] = result = validate(name, requests, arrivals, args, stored.get(name))
        save(args, rows)  # after each configuration: a later one that fails loses nothing
        before, after = result["load_average_before_after"]
        timeline = {w: (round(t.get("measured_slowdown_p50", float("nan")), 2), round(t.get("modelled_slowdown_p50", 1.0), 2),
                        round(t["host_share_p50"], 3)) for w, t in result["step_timeline"].items()}
        print(f"{name}: {result['wall_s']:.0f} s, load average {before[0]:.1f} -> {after[0]:.1f}, router overhead "
              f"{result['request_overhead_ms']:.1f} ms, cores {result['core_sharing']}; per worker (contended pass "
              f"slowdown measured, modelled; host share of a pass), p50: {timeline}", flush=True)
    header = "| config | TTFT p50 meas / sim (err) | TTFT p90 | TBT p50 | TBT p90 |\n|---|---|---|---|---|"
    print(f"\n{len(requests)} requests at {args.rate} req/s; times in ms\n{header}")
    for name, result in rows.items():
        print(row(name, result["errors"]["simulated"]))
    print(f"\nwithout each term (same measurements)\n{header}")
    for name, result in rows.items():
        for label, errs in result["errors"].items():
            if label != "simulated":
                print(row(f"{name}, {label}", errs))
    worst = max(abs(e["error"]) for r in rows.values() for e in r["errors"]["simulated"].values())
    print(f"\nworst error {worst:.0%} (target {TARGET_ERROR:.0%})")
    print(f"wrote {args.out}")


def save(args, rows: dict) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
