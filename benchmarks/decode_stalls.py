"""What stalls a decode stream: the client's token gaps beside the decode worker's own passes.

    export PYTHONPATH=$PWD
    .venv/bin/python benchmarks/decode_stalls.py --prompts FILE [--colocated] [--num-prompts 64]

Starts a local cluster (1P+1D, or colocated) with the workers logging every pass (DEBUG), drives
the peer benchmark's workload (chat-templated prompts, 64 output tokens with ``ignore_eos``,
concurrency 16) and prints, side by side: the client's TBT p50 / p90 / p99 / max (all gaps, the
first gap of each stream alone: in 1P+1D it spans the prefill -> pool -> decode handoff, and the
later gaps); the decode
worker's pass durations by kind (pure decode, decode with a prompt chunk mixed in) and the idle
gaps between its passes; and, for each client gap over ``--stall-factor`` x the p50, what the
decode worker was doing then (the passes overlapping the gap, their tokens and duration, and any
idle time) and how many of the other open streams received a token within it (all of them: the
decode worker's pass was long; none: a shared delivery path stalled; only this one missing: this
stream's own handoff or preemption). A prompt file is any set ``tandem bench`` reads (ShareGPT JSON, ...); without one the
built-in prompts run, repeated.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.arrivals import ArrivalConfig  # noqa: E402
from bench.client import ClientConfig  # noqa: E402
from bench.runner import run  # noqa: E402
from bench.hf_baseline import chat_token_ids  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from benchmarks.step_timeline import Pass, read_passes  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402
from launcher.config import ClusterConfig  # noqa: E402
from launcher.local_cluster import LocalCluster  # noqa: E402
from launcher.ports import free_port  # noqa: E402
from bench.prompts import BUILTIN_PROMPTS, load_prompts  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def describe(values_ms: list[float]) -> str:
    return (f"n={len(values_ms)} p50 {pct(values_ms, 0.5):.0f} p90 {pct(values_ms, 0.9):.0f} "
            f"p99 {pct(values_ms, 0.99):.0f} max {max(values_ms, default=float('nan')):.0f} ms")


def during(passes: list[Pass], start_s: float, end_s: float) -> list[Pass]:
    return [p for p in passes if p.end_s > start_s and p.start_s < end_s]


def analyze(records, run_started_s: float, passes: list[Pass], stall_factor: float) -> dict:
    # (when, gap, index of the token that ended it: 1 = the first gap, the prefill -> decode handoff)
    gaps = [(r.start_s + t0, (t1 - t0), k + 1, r) for r in records if r.ok
            for k, (t0, t1) in enumerate(zip(r.chunk_times_s, r.chunk_times_s[1:]))]
    gap_ms = [g * 1e3 for _, g, _, _ in gaps]
    later_ms = [g * 1e3 for _, g, k, _ in gaps if k > 1]
    first_ms = [g * 1e3 for _, g, k, _ in gaps if k == 1]
    decode_only = [p.sample.duration_s * 1e3 for p in passes if p.sample.num_new_tokens == p.sample.num_seqs]
    mixed = [p for p in passes if p.sample.num_new_tokens > p.sample.num_seqs]
    idle_ms = [(b.start_s - a.end_s) * 1e3 for a, b in zip(passes, passes[1:]) if b.start_s > a.end_s]
    p50_s = pct([g for _, g, _, _ in gaps], 0.5)
    stalls = []
    for at_s, gap_s, token, owner in sorted(gaps, key=lambda g: -g[1]):
        if gap_s < stall_factor * p50_s or len(stalls) >= 12:
            break
        start_s = run_started_s + at_s
        overlapping = during(passes, start_s, start_s + gap_s)
        busy_s = sum(min(p.end_s, start_s + gap_s) - max(p.start_s, start_s) for p in overlapping)
        # The other streams then: were they served (a shared delivery path would stall them all)?
        open_streams = [r for r in records if r.ok and r is not owner and r.chunk_times_s
                        and r.start_s + r.chunk_times_s[0] < at_s and r.start_s + r.chunk_times_s[-1] > at_s + gap_s]
        served = [r for r in open_streams if any(at_s < r.start_s + t < at_s + gap_s for t in r.chunk_times_s)]
        stalls.append({"gap_ms": round(gap_s * 1e3), "token": token, "decode_busy_ms": round(busy_s * 1e3),
                       "passes": [(p.sample.num_new_tokens, p.sample.num_seqs, round(p.sample.duration_s * 1e3))
                                  for p in overlapping],
                       "streams_open": len(open_streams), "streams_served": len(served)})
    return {"client_tbt": describe(gap_ms), "client_tbt_first_gap": describe(first_ms),
            "client_tbt_later_gaps": describe(later_ms), "decode_passes": describe(decode_only),
            "mixed_passes": describe([p.sample.duration_s * 1e3 for p in mixed]),
            "mixed_prompt_tokens": sorted(p.sample.num_new_tokens - p.sample.num_seqs for p in mixed)[-10:],
            "idle_gaps": describe(idle_ms), "stalls": stalls}


def worker_options(flags: list[str]) -> dict:
    """The worker flags given (``--linear-backend mkl``, ...) as typed ``tandem up`` options,
    read by the worker's own command line."""
    from decode_worker.__main__ import main as worker_main

    ctx = worker_main.make_context("decode_worker", list(flags))
    return {name: value for name, value in ctx.params.items()
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=Path, default=None, help="prompt set (ShareGPT JSON, ...)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--stall-factor", type=float, default=2.0)
    parser.add_argument("--worker-arg", action="append", default=[], help="extra worker flag (repeatable)")
    parser.add_argument("--num-threads", type=int, default=0, help="tandem up --num-threads (0: every core)")
    parser.add_argument("--pin", action="store_true",
                        help="after start, pin the decode worker to CPU 0 and the prefill worker to CPU 1 "
                             "(taskset -a): dedicated cores instead of shared ones (and no core sharing)")
    parser.add_argument("--no-share-cores", action="store_true",
                        help="disaggregated: each role keeps its own cores (tandem up --no-share-cores)")
    parser.add_argument("--log-dir", type=Path, default=Path("bench-results/decode_stalls"))
    parser.add_argument("--out", type=Path, default=Path("bench-results/decode_stalls.json"))
    args = parser.parse_args()
    source = resolve_model(DEFAULT_MODEL)
    texts = (load_prompts(args.prompts, args.num_prompts) if args.prompts and args.prompts.is_file()
             else [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(args.num_prompts)])
    prompts = chat_token_ids(ensure_hf_dir(source), texts)
    requests = [BenchRequest(p, args.max_tokens, expected_input_tokens=len(p)) for p in prompts]
    config = ClusterConfig.from_options(model=DEFAULT_MODEL, http_port=free_port(), grpc_port=free_port(),
                                        colocated=args.colocated, log_dir=args.log_dir, num_threads=args.num_threads,
                                        # pinned, each worker has one CPU: nothing to borrow (engine.core_share)
                                        share_cores=not (args.pin or args.no_share_cores),
                                        **worker_options(args.worker_arg))
    config = dataclasses.replace(config, worker=dataclasses.replace(config.worker, log_level="DEBUG"))
    with LocalCluster(config) as cluster:
        cluster.start()
        if args.pin:
            for role, cpu in (("decode", "0"), ("prefill", "1")):
                for service in cluster.worker_services(role):
                    subprocess.run(["taskset", "-a", "-p", "-c", cpu, str(service.process.pid)], check=True,
                                   capture_output=True)
        client = ClientConfig(url=cluster.http_url, model=source.name, ignore_eos=True, timeout_s=600)
        asyncio.run(run(requests[:1], ArrivalConfig("concurrency", concurrency=1), client, show_progress=False,
                        label="warm-up"))
        started_s = time.time()
        result = asyncio.run(run(requests, ArrivalConfig("concurrency", concurrency=args.concurrency), client,
                                 show_progress=False, label="run"))
    decode_log = sorted(args.log_dir.glob("decode*.log"))[0]
    passes = read_passes(decode_log, started_s)
    report = analyze(result.records, started_s, passes, args.stall_factor)
    report["mode"] = ("colocated" if args.colocated else "1P+1D") + (" pinned" if args.pin else "") + \
        (f" {args.num_threads} threads" if args.num_threads else "")
    report["out_tok_per_s"] = round(sum(len(r.chunk_times_s) for r in result.records if r.ok) / result.duration_s, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
