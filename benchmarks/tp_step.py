"""Per-rank step time and the all-reduce share of the step, TP=1 against TP=2, in process.

    .venv/bin/python benchmarks/tp_step.py [--cores 2] [--batch 1 --batch 16] [--context 150]

For each degree it builds one engine on the real model (TP=1: ``cores`` threads; TP=2: two
ranks of ``cores // 2`` threads each, gloo on the CPU, so both use the same cores), admits
``batch`` requests of ``context`` random tokens, lets them prefill, and times ``passes`` decode
passes, plus one prefill pass of ``--prefill-tokens`` tokens. Each rank reports its forward time
(rank 0: forward + sampling) and the time inside its collectives (the two all-reduces of every
decoder layer and the LM head's all-gather) through ``TensorParallelRunner.rank_timings``. Prints
one table, writes JSON. Numbers from a loaded machine are descriptive only.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.model_source import DEFAULT_MODEL  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.parallel.group import CollectiveTimer  # noqa: E402


def requests(engine: LLMEngine, batch: int, context: int, max_tokens: int, tag: str) -> list[Request]:
    rng = random.Random(tag)
    vocab = engine.runner.model.config.vocab_size
    return [Request(f"{tag}-{i}", [rng.randrange(100, vocab) for _ in range(context)],
                    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)) for i in range(batch)]


def timings(engine: LLMEngine) -> list[CollectiveTimer]:
    """Every rank's timer since the last call (TP=1: rank 0's busy time, no collectives)."""
    if engine.parallel is None:
        busy, engine.runner.busy_time_s = engine.runner.busy_time_s, 0.0
        return [CollectiveTimer(forward_s=busy)]
    return engine.runner.rank_timings()


def decode_passes(engine: LLMEngine, batch: int, context: int, passes: int) -> list[CollectiveTimer]:
    """Timers of ``passes`` decode passes at ``batch`` sequences (prefill excluded)."""
    reqs = requests(engine, batch, context, passes + 2, f"d{batch}")
    for r in reqs:
        engine.add_request(r)
    measured = None
    for _ in engine.step_stream():
        done = min(r.num_output_tokens for r in reqs)
        if done == 1 and measured is None:  # every prompt prefilled: start the window
            timings(engine)
            measured = []
        if done == passes + 1 and not measured:
            measured = timings(engine)
    return measured


def prefill_pass(engine: LLMEngine, num_tokens: int) -> list[CollectiveTimer]:
    timings(engine)
    engine.add_request(requests(engine, 1, num_tokens, 1, "p")[0])
    engine.step()
    return timings(engine)


def rows_of(tp: int, case: str, per_rank: list[CollectiveTimer], passes: int) -> list[dict]:
    return [{"tp": tp, "case": case, "rank": rank, "step_ms": t.forward_s / passes * 1e3,
             "all_reduce_ms": t.all_reduce_s / passes * 1e3,
             "all_reduce_share": t.all_reduce_s / t.forward_s if t.forward_s else 0.0,
             "control_ms": t.control_s / passes * 1e3} for rank, t in enumerate(per_rank)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="cores shared by the ranks")
    parser.add_argument("--batch", type=int, action="append", help="decode batch sizes (default 1 and 16)")
    parser.add_argument("--context", type=int, default=150)
    parser.add_argument("--passes", type=int, default=24)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--tp", type=int, action="append", help="degrees (default 1 and 2)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/tp_step.json"))
    args = parser.parse_args(argv)
    rows = []
    for tp in args.tp or [1, 2]:
        config = EngineConfig(model=args.model, num_kv_blocks=1024, max_model_len=2048, max_num_batched_tokens=2048,
                              num_threads=max(1, args.cores // tp), tensor_parallel_size=tp)
        engine = LLMEngine.from_config(config)
        try:
            decode_passes(engine, 1, args.context, 3)  # warm
            for batch in args.batch or [1, 16]:
                rows += rows_of(tp, f"decode b={batch}", decode_passes(engine, batch, args.context, args.passes),
                                args.passes)
            rows += rows_of(tp, f"prefill {args.prefill_tokens} tok", prefill_pass(engine, args.prefill_tokens), 1)
        finally:
            engine.shutdown()
    print(f"{'TP':>3} {'case':<18} {'rank':>4} {'step ms':>9} {'all-reduce ms':>14} {'share':>7} {'control ms':>11}")
    for r in rows:
        print(f"{r['tp']:>3} {r['case']:<18} {r['rank']:>4} {r['step_ms']:>9.2f} {r['all_reduce_ms']:>14.2f} "
              f"{r['all_reduce_share']:>6.0%} {r['control_ms']:>11.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cores": args.cores, "context": args.context, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
