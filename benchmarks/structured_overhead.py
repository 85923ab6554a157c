"""The step-time cost of structured outputs: decode passes with a JSON-schema grammar on every
row against the same passes without one, in process on the real model.

    .venv/bin/python benchmarks/structured_overhead.py [--batch 1 --batch 16] [--rounds 3]

For each batch size it builds one engine, then alternates rounds (free, structured, free, ...)
so both see the same machine load. A round admits ``batch`` requests of ``context`` random prompt
tokens, lets them prefill, and times ``passes`` decode passes: the ModelRunner's busy time per
pass (forward, waiting for the bitmask fill that ran beside it, the mask, sampling, the
matchers' accept; no RPC). Structured rows follow a schema whose one string must be at least
``--min-chars`` long, so no row can end inside the timed passes; free rows use ``ignore_eos``.
Prints the medians and the overhead; writes JSON.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.model_source import DEFAULT_MODEL  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from core.structured_output import StructuredOutputSpec  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402


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
    while engine.structured.num_waiting:  # the grammar compiles on its thread (cached after round 1)
        time.sleep(0.001)
    times_ms = []
    busy = engine.runner.busy_time_s
    for _ in engine.step_stream():
        now = engine.runner.busy_time_s
        if all(r.num_output_tokens >= 2 for r in requests) and not any(r.is_finished for r in requests):
            times_ms.append((now - busy) * 1e3)
        busy = now
    assert all(r.finish_reason.value == "length" for r in requests)  # no row left early
    return times_ms[:passes]


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
        rows.append({"batch": batch, "free_ms": free_ms, "structured_ms": structured_ms,
                     "overhead_pct": 100 * (structured_ms / free_ms - 1), "passes": len(free)})
    load = os.getloadavg()[0]
    print(f"{'batch':>5} {'free ms':>9} {'json_schema ms':>15} {'overhead':>9}   (load {load:.1f}, {os.cpu_count()} cpus)")
    for row in rows:
        print(f"{row['batch']:>5} {row['free_ms']:>9.2f} {row['structured_ms']:>15.2f} {row['overhead_pct']:>8.1f}%")
    print(f"grammar compiles: {engine.structured.stats.num_compiled}, "
          f"{engine.structured.stats.compile_time_s * 1e3:.1f} ms in all")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "load_1m": load, "cpus": os.cpu_count(),
                                    "context": args.context, "overlap": args.overlap}, indent=2))
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
