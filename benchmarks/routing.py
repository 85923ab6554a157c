"""Routing policies side by side on one shared-prefix workload: round_robin,
least_loaded, cache_aware and predicted_latency, each on a fresh local cluster of 2 prefill + 2
decode workers (real processes, real model), same requests, same arrival times.

    python benchmarks/routing.py [--num-requests 48] [--time-scale 0.1] [--out routing.json]

Workload: multi-turn conversations of the Mooncake FAST'25 conversation trace. A conversation is
the rows sharing their first two hash blocks (the system prompt, then the conversation's first
turn); its later turns extend earlier ones, so their prompts are mostly cached. Conversations with
at least ``--min-turns`` turns are taken in order of first appearance until ``--num-requests``
rows; prompts are synthesized with the trace's exact prefix sharing (bench.synthesis) at
``--length-scale`` (1/32: the trace's 512-token hash block becomes one 16-token KV block), outputs
at ``--output-scale``, arrivals at the trace's timestamps times ``--time-scale``. The goodput SLOs are also given to the
router (``--router-slo``, placement only: admission is off so every policy serves every request).

Reports per policy: mean and p90 TTFT, goodput (requests/s within ``--ttft-slo-ms`` and
``--tbt-slo-ms``, bench.metrics), and the router's placements by mode; a markdown table on stdout
and everything as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.arrivals import ArrivalConfig  # noqa: E402
from bench.client import ClientConfig  # noqa: E402
from bench.metrics import SLO, summarize  # noqa: E402
from bench.runner import run  # noqa: E402
from bench.synthesis import PrefixSynthesizer, SynthesisConfig  # noqa: E402
from bench.traces import TraceRow, read_mooncake  # noqa: E402
from bench.workloads import BenchRequest  # noqa: E402
from core.datasets import data_file  # noqa: E402
from launcher.config import ClusterConfig  # noqa: E402
from launcher.local_cluster import LocalCluster  # noqa: E402
from launcher.ports import free_port  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TRACE = data_file("mooncake")  # the data folder's Mooncake trace (docs/data.md)
POLICIES = ("round_robin", "least_loaded", "cache_aware", "predicted_latency")
MAX_MODEL_LEN = 2048


def conversation_rows(rows: list[TraceRow], num_requests: int, min_turns: int) -> list[TraceRow]:
    """Rows of the first conversations (same first two hash blocks) with >= ``min_turns`` turns,
    whole conversations, until ``num_requests`` rows; in arrival order."""
    conversations: dict[tuple[int, ...], list[TraceRow]] = defaultdict(list)
    for row in rows:
        if len(row.hash_ids) >= 2:
            conversations[row.hash_ids[:2]].append(row)
    chosen: list[TraceRow] = []
    for turns in conversations.values():  # dicts keep first-appearance order
        if len(turns) >= min_turns and len(chosen) < num_requests:
            chosen += turns[: num_requests - len(chosen)]
    return sorted(chosen, key=lambda r: r.arrival_s)


def workload(args: argparse.Namespace) -> list[BenchRequest]:
    """Synthesized prompts of the chosen rows (prefix sharing exact), too-long rows dropped."""
    synthesis = SynthesisConfig(length_scale=args.length_scale, output_scale=args.output_scale)
    rows = [r for r in read_mooncake(args.trace)
            if synthesis.scale_input(r.input_tokens) + args.max_output_tokens < MAX_MODEL_LEN - 16]
    synthesizer = PrefixSynthesizer(synthesis)
    requests = []
    for index, row in enumerate(conversation_rows(rows, args.num_requests, args.min_turns)):
        prompt = synthesizer.prompt(row, index)
        output_tokens = min(args.max_output_tokens, synthesis.scale_output(row.output_tokens))
        requests.append(BenchRequest(prompt, output_tokens, row.arrival_s, len(prompt)))
    return requests


def shared_prefix_fraction(requests: list[BenchRequest], block: int) -> float:
    """Fraction of prompt tokens in full blocks an earlier prompt already had (an ideal cache's hits)."""
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for r in requests:
        total += len(r.prompt)
        for end in range(block, len(r.prompt) + 1, block):
            key = tuple(r.prompt[:end])
            hits += block if key in seen else 0
            seen.add(key)
    return hits / max(1, total)


def cost_models_ready(redis_url: str, num_workers: int) -> bool:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        values = client.mget(client.keys("tandem:workers:*")) if client.keys("tandem:workers:*") else []
        return sum(1 for v in values if v and json.loads(v)["load"].get("cost_num_samples", 0) > 0) >= num_workers
    finally:
        client.close()


def placements(metrics_text: str) -> dict[str, float]:
    """tandem:placements_total by mode, from the router's /metrics."""
    found = re.findall(r'tandem:placements_total\{mode="(\w+)",policy="\w+"\} ([0-9.e+]+)', metrics_text)
    return {mode: float(value) for mode, value in found}


def router_slo_options(args: argparse.Namespace) -> dict[str, float]:
    """The goodput SLOs handed to the router too (placement only: admission off, so every
    policy serves every request)."""
    if not args.router_slo:
        return {}
    return {"ttft_slo_s": args.ttft_slo_ms / 1000, "tbt_slo_s": args.tbt_slo_ms / 1000, "max_queue_s": 1e9}


def run_policy(policy: str, requests: list[BenchRequest], args: argparse.Namespace, log_dir: Path) -> dict:
    config = ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN,
        max_num_batched_tokens=512, num_threads=args.num_threads, num_prefill_workers=2, num_decode_workers=2,
        log_dir=log_dir / policy, routing_policy=policy, **router_slo_options(args),
    )
    with LocalCluster(config) as cluster:
        started = time.monotonic()
        cluster.start()
        deadline = time.monotonic() + 120
        while not cost_models_ready(cluster.redis_url, 4):  # start-up calibration, polled
            if time.monotonic() > deadline:
                raise RuntimeError("workers published no cost model within 120 s")
            time.sleep(0.5)
        print(f"[{policy}] cluster up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        client = ClientConfig(url=cluster.http_url, model=MODEL, ignore_eos=True, timeout_s=600)
        arrivals = ArrivalConfig(mode="trace", time_scale=args.time_scale)
        result = asyncio.run(run(requests, arrivals, client, show_progress=False, label=policy))
        metrics_text = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    summary = summarize(result.records, result.duration_s, SLO(args.ttft_slo_ms, args.tbt_slo_ms))
    summary["placements"] = placements(metrics_text)
    return summary


def table(results: dict[str, dict]) -> str:
    lines = ["| policy | ok | mean TTFT (ms) | p90 TTFT (ms) | p90 TBT (ms) | goodput (req/s) | SLO attainment | colocated |",
             "|---|---|---|---|---|---|---|---|"]
    for policy, s in results.items():
        placed = s["placements"]
        colocated = f"{placed.get('colocated', 0):.0f}/{sum(placed.values()):.0f}"
        lines.append(f"| {policy} | {s['num_ok']}/{s['num_requests']} | {s['ttft_ms']['mean']:.0f} | "
                     f"{s['ttft_ms']['p90']:.0f} | {s['tbt_ms']['p90']:.0f} | {s['goodput_rps']:.3f} | "
                     f"{s['slo_attainment']:.2f} | {colocated} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--min-turns", type=int, default=3)
    parser.add_argument("--length-scale", type=float, default=1 / 32)
    parser.add_argument("--output-scale", type=float, default=1 / 32)
    parser.add_argument("--max-output-tokens", type=int, default=16)
    parser.add_argument("--time-scale", type=float, default=0.1, help="send time = trace time x this")
    parser.add_argument("--ttft-slo-ms", type=float, default=4000.0, help="goodput TTFT SLO (this CPU's scale)")
    parser.add_argument("--tbt-slo-ms", type=float, default=600.0, help="goodput TBT SLO (p90 of a request's gaps)")
    parser.add_argument("--router-slo", action=argparse.BooleanOptionalAction, default=True,
                        help="also give the SLOs to the router (placement; admission stays off)")
    parser.add_argument("--num-threads", type=int, default=2, help="CPU threads shared by the 4 workers")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--log-dir", type=Path, default=Path(".cache/logs/routing-bench"))
    parser.add_argument("--out", type=Path, default=None, help="JSON results")
    args = parser.parse_args()
    requests = workload(args)
    span_s = (max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)) * args.time_scale
    info = {"num_requests": len(requests), "mean_prompt_tokens": sum(len(r.prompt) for r in requests) / len(requests),
            "mean_output_tokens": sum(r.max_tokens for r in requests) / len(requests),
            "shared_prefix_fraction": shared_prefix_fraction(requests, 16), "arrival_span_s": span_s}
    print(f"workload: {json.dumps(info)}", file=sys.stderr)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, requests, args, args.log_dir)
        print(table({policy: results[policy]}).splitlines()[-1], file=sys.stderr)
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"workload": info, "args": {k: str(v) for k, v in vars(args).items()},
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
