"""The step-time cost of structured outputs: decode passes with a JSON-schema grammar on every
row against the same passes without one, in process on the real model.

    .venv/bin/python benchmarks/structured_overhead.py [--batch 1 --batch 16] [--rounds 3]

For each batch size it builds one engine, then alternates rounds (free, structured, free, ...)
so both see the same machine load. A round admits ``batch`` requests of ``context`` random prompt
tokens, lets them prefill, and times ``passes`` decode passes: the ModelRunner's busy time per
pass (forward, waiting for the bitmask fill that ran beside it, the mask, sampling, the
matchers' accept; no RPC). Structured rows follow a schema whose one string must be at least
``--min-chars`` long, so no row can end inside the timed passes; free rows use ``ignore_eos``.
Prints the medians and the overhead (and the minima's: the least disturbed passes), then the
three pieces structured outputs add to a pass timed alone at the same batch (bitmask fill, mask,
accept) as a share of the free pass; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.model_source import DEFAULT_MODEL  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from core.structured_output import StructuredOutputSpec  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.outputs import SampledToken, SamplingInput  # noqa: E402


def schema_spec(min_chars: int) -> StructuredOutputSpec:
    return StructuredOutputSpec.json_schema({
        "type": "object", "properties": {"text": {"type": "string", "minLength": min_chars}},
        "required": ["text"], "additionalProperties": False}, strict=True)


def pass_times_ms(engine: LLMEngine, batch: int, context: int, passes: int, spec: StructuredOutputSpec | None,
                  seed: int) -> list[float]:
    """Runner busy time (ms) of each of ``passes`` decode passes once every row decodes."""
    rng = random.Random(seed)
    vocab = engine.runner.model.config.vocab_size
    params = (SamplingParams(temperature=0, max_tokens=passes + 3, structured_outputs=spec) if spec is not None
              else SamplingParams(temperature=0, max_tokens=passes + 3, ignore_eos=True))
    requests = [Request(f"s{seed}-{i}", [rng.randrange(100, vocab) for _ in range(context)], params)
                for i in range(batch)]
    for request in requests:
        engine.add_request(request)
    times_ms = []
    busy = engine.runner.busy_time_s
    while engine.has_unfinished_requests():  # step_stream returns at once while the grammar compiles
        for _ in engine.step_stream():
            now = engine.runner.busy_time_s
            if all(r.num_output_tokens >= 2 for r in requests) and not any(r.is_finished for r in requests):
                times_ms.append((now - busy) * 1e3)
            busy = now
    assert all(r.finish_reason.value == "length" for r in requests)  # no row left early
    return times_ms[:passes]


def component_times_ms(engine: LLMEngine, batch: int, spec: StructuredOutputSpec, reps: int = 50) -> dict[str, float]:
    """Median ms of the three per-pass pieces structured outputs add, at ``batch`` structured
    rows, timed alone (less sensitive to machine load than whole passes): the batched bitmask
    fill, the mask applied to ``[batch, vocab]`` float32 logits, and the matchers' accept. Each
    repetition accepts one more token (the schema's long string never ends inside them)."""
    vocab = engine.runner.model.config.vocab_size
    requests = [Request(f"c{i}", [5], SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec))
                for i in range(batch)]
    manager = engine.structured
    for request in requests:
        manager.add(request, None)
    while manager.num_waiting:
        manager.admit_ready(lambda r, kv: None)
    rows = [SamplingInput(r.request_id, r.sampling_params, 0, frozenset(), r.prompt_token_ids, []) for r in requests]
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    base = torch.randn(batch, vocab)
    for _ in range(reps):
        logits = base.clone()
        started = time.perf_counter()
        mask = manager.fill(rows)
        filled = time.perf_counter()
        mask.apply(logits)
        applied = time.perf_counter()
        tokens = [SampledToken(int(t)) for t in logits.argmax(-1)]  # allowed: the mask was applied
        manager.accept(rows, tokens)
        accepted = time.perf_counter()
        times["fill"].append((filled - started) * 1e3)
        times["apply"].append((applied - filled) * 1e3)
        times["accept"].append((accepted - applied) * 1e3)
    for request in requests:
        manager.discard(request.request_id)
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 16)")
    parser.add_argument("--context", type=int, default=150, help="prompt tokens per sequence")
    parser.add_argument("--passes", type=int, default=24, help="timed decode passes per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind, alternated")
    parser.add_argument("--min-chars", type=int, default=2000, help="the schema's minLength")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--overlap", action="store_true", help="overlap scheduling on")
    parser.add_argument("--out", type=Path, default=Path("bench-results/structured_overhead.json"))
    args = parser.parse_args(argv)
    spec = schema_spec(args.min_chars)
    config = EngineConfig(model=args.model, num_kv_blocks=1024, max_model_len=2048, num_threads=args.threads,
                          enable_overlap=args.overlap)
    engine = LLMEngine.from_config(config)
    pass_times_ms(engine, 2, args.context, 4, spec, seed=0)  # warm-up: compile, first allocations
    rows = []
    for batch in args.batch or [1, 16]:
        free: list[float] = []
        structured: list[float] = []
        for r in range(args.rounds):
            free += pass_times_ms(engine, batch, args.context, args.passes, None, seed=2 * r + 1)
            structured += pass_times_ms(engine, batch, args.context, args.passes, spec, seed=2 * r + 2)
        free_ms, structured_ms = statistics.median(free), statistics.median(structured)
        parts = component_times_ms(engine, batch, spec)
        rows.append({"batch": batch, "free_ms": free_ms, "structured_ms": structured_ms,
                     "overhead_pct": 100 * (structured_ms / free_ms - 1), "passes": len(free),
                     "free_min_ms": min(free), "structured_min_ms": min(structured),
                     **{f"{name}_ms": value for name, value in parts.items()},
                     "components_pct": 100 * sum(parts.values()) / free_ms})
    load = os.getloadavg()[0]
    print(f"{'batch':>5} {'free ms':>9} {'json_schema ms':>15} {'overhead':>9} {'(min/min)':>10}  "
          f"{'fill ms':>8} {'apply ms':>8} {'accept ms':>9} {'parts/free':>10}   (load {load:.1f}, {os.cpu_count()} cpus)")
    for row in rows:
        min_pct = 100 * (row["structured_min_ms"] / row["free_min_ms"] - 1)
        print(f"{row['batch']:>5} {row['free_ms']:>9.2f} {row['structured_ms']:>15.2f} {row['overhead_pct']:>8.1f}% "
              f"{min_pct:>9.1f}%  {row['fill_ms']:>8.3f} {row['apply_ms']:>8.3f} {row['accept_ms']:>9.3f} "
              f"{row['components_pct']:>9.1f}%")
    print(f"grammar compiles: {engine.structured.stats.num_compiled}, "
          f"{engine.structured.stats.compile_time_s * 1e3:.1f} ms in all")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "load_1m": load, "cpus": os.cpu_count(),
                                    "context": args.context, "overlap": args.overlap}, indent=2))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
