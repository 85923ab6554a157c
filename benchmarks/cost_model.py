"""How well a worker's fitted cost model (core.cost_model) predicts its own steps.

Engine-level (no RPC), real model, real prompts (the ShareGPT set in the data folder, docs/data.md, or synthetic
lengths without it). Prints the fitted coefficients and the mean absolute % error (MAPE) of:

1. held-out steps of a mixed workload (prefill-only, decode-only and mixed passes), step_s vs the
   measured forward time;
2. held-out requests' prefill alone on the worker, prefill_s(uncached, cached) vs the wall time
   of the passes (prompts with and without a cached shared prefix);
3. decode passes of batches of 1..32 sequences, decode_step_s(batch, kv_tokens) vs wall time;

each for the model right after start-up calibration (what the router sees first), the model
fitted on a separate mixed workload (frozen), and "online": the model the worker publishes at
that moment (its sliding window refitted every 16 passes, as in a running worker).

    python benchmarks/cost_model.py [--prompts PATH] [--num-fit 32] [--num-heldout 12] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.cost_model import CostModel  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.calibration import calibrate  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from bench.prompts import load_prompts  # noqa: E402
from core.datasets import data_file  # noqa: E402

SHAREGPT_DEFAULT = data_file("sharegpt")  # the data folder's ShareGPT set (docs/data.md)

MAX_MODEL_LEN = 2048
SYSTEM = "You are a careful assistant of a bicycle shop. Answer in plain English, briefly and precisely. " * 6


def mape(pairs: list[tuple[float, float]]) -> float:
    """Mean absolute % error of (predicted, measured) pairs."""
    return 100 * statistics.fmean(abs(p - m) / m for p, m in pairs) if pairs else float("nan")


def load_prompts_ids(args, tokenizer, n: int) -> list[list[int]]:
    """n chat prompts (ShareGPT when present), or random tokens of log-normal lengths."""
    if args.prompts is not None and args.prompts.exists():
        ids = []
        for text in load_prompts(args.prompts, n, max_chars=4000):
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            ids.append(list(chat["input_ids"] if hasattr(chat, "keys") else chat)[:768])
        return ids
    rng = random.Random(1)
    return [[rng.randrange(3, 40000) for _ in range(min(768, int(rng.lognormvariate(5, 1)) + 8))] for _ in range(n)]


def mixed_workload(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str):
    """Requests arrive 4 at a time every 3 passes, output lengths 1..2*max_tokens-1; yields each
    pass's StepSample (so prefill chunks ride beside decodes, as on a colocated worker)."""
    pending = list(enumerate(prompts))

    def admit() -> None:
        for i, p in pending[:4]:
            length = 1 + (i * 37) % (2 * max_tokens - 1)
            engine.add_request(Request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=length,
                                                                      ignore_eos=True)))
        del pending[:4]

    passes = 0
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            admit()
        for _ in engine.step_stream():  # requests may join between passes
            passes += 1
            yield engine.step_stats.last
            if passes % 3 == 0:
                admit()


Row = tuple[str, dict[str, float], float]  # (what, predicted seconds per model, measured seconds)


class Models:
    """The models compared: after calibration, after the fit workload (both frozen), and
    "online": what the worker would publish right now (refitted as it runs)."""

    def __init__(self, engine: LLMEngine, calibrated: CostModel, fitted: CostModel):
        self.engine, self.frozen = engine, {"calibrated": calibrated, "fitted": fitted}

    def now(self) -> dict[str, CostModel]:
        return {**self.frozen, "online": self.engine.stats().cost_model}


def heldout_steps(engine: LLMEngine, models: Models, prompts, max_tokens: int) -> list[Row]:
    rows, current = [], models.now()
    for s in mixed_workload(engine, prompts, max_tokens, "steps"):
        kind = "decode-only" if s.num_new_tokens == s.num_seqs else "prefill-only" if s.num_seqs == 1 else "mixed"
        predicted = {name: m.step_s(s.num_new_tokens, s.num_seqs, s.attn_pairs) for name, m in current.items()}
        rows.append((f"step_s vs forward time, {kind} passes", predicted, s.duration_s))
        current = models.now()
    return rows


def heldout_prefills(engine: LLMEngine, models: Models, prompts, system: list[int]) -> list[Row]:
    """Each prompt prefilled alone (only the chat template's shared tokens may be cached), then
    after a cached shared system prompt: prefill_s(uncached, cached) vs the passes' wall time."""
    rows = []
    engine.add_request(Request("warm", system + prompts[0], SamplingParams(temperature=0, max_tokens=1)))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        for label, ids in (("own prompt", p), ("after a cached system prompt", system + p)):
            current = models.now()
            engine.add_request(Request(f"pf-{label[:3]}-{i}", ids, SamplingParams(temperature=0, max_tokens=1)))
            started, cached = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    cached = o.num_cached_tokens
            wall = time.perf_counter() - started
            rows.append((f"prefill_s vs wall, {label}", {n: m.prefill_s(len(ids) - cached, cached)
                                                         for n, m in current.items()}, wall))
    return rows


def decode_batches(engine: LLMEngine, models: Models, prompts, sizes: list[int]) -> list[Row]:
    """decode_step_s(batch, kv_tokens) vs the wall time of each pure decode pass."""
    rows = []
    for b in sizes:
        for i in range(b):
            p = prompts[i % len(prompts)][:200]
            engine.add_request(Request(f"dec{b}-{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
        last, kv, current = time.perf_counter(), 0, models.now()
        for _ in engine.step_stream():
            now, s = time.perf_counter(), engine.step_stats.last
            if s.num_new_tokens == s.num_seqs == b:
                rows.append((f"decode_step_s vs wall, batch {b}", {n: m.decode_step_s(b, kv)
                                                                   for n, m in current.items()}, now - last))
            kv = sum(r.num_computed_tokens for r in engine.scheduler.running)  # the next pass attends this
            current = models.now()
            last = time.perf_counter()
    return rows


def report(rows: list[Row]) -> None:
    names = list(rows[0][1])
    print("\nMAPE (mean absolute % error) on held-out data".ljust(58) + "".join(f"{n:>12}" for n in names) + "     n")
    for what in dict.fromkeys(r[0] for r in rows):
        mine = [r for r in rows if r[0] == what]
        errors = [mape([(r[1][n], r[2]) for r in mine]) for n in names]
        print(f"  {what}".ljust(58) + "".join(f"{e:11.1f}%" for e in errors) + f"{len(mine):6d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=SHAREGPT_DEFAULT if SHAREGPT_DEFAULT.exists() else None)
    parser.add_argument("--num-fit", type=int, default=32)
    parser.add_argument("--num-heldout", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=16, help="mean output length")
    parser.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    parser.add_argument("--calibration-steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="12 fit, 6 held-out prompts, 8 tokens")
    args = parser.parse_args()
    if args.quick:
        args.num_fit, args.num_heldout, args.max_tokens = 12, 6, 8
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    source = resolve_model(DEFAULT_MODEL)
    hf_dir = ensure_hf_dir(source)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    model = load_model(hf_dir, "float32", "cpu", MAX_MODEL_LEN)
    config = EngineConfig(block_size=16, num_kv_blocks=1024, max_num_seqs=32, max_num_batched_tokens=args.budget,
                          max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(config, model, source)
    prompts = load_prompts_ids(args, tokenizer, args.num_fit + 2 * args.num_heldout)
    fit_prompts, held = prompts[: args.num_fit], prompts[args.num_fit:]
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min), {os.cpu_count()} CPUs, {args.threads} threads; "
          f"{len(prompts)} prompts ({args.prompts or 'synthetic'}), mean {statistics.fmean(map(len, prompts)):.0f} tokens")

    result = calibrate(engine, args.calibration_steps, max_duration_s=float("inf"))
    calibrated = engine.stats().cost_model
    print(f"calibration: {result.num_steps} passes in {result.duration_s:.2f} s")
    started = time.perf_counter()
    n = sum(1 for _ in mixed_workload(engine, fit_prompts, args.max_tokens, "fit"))
    fitted = engine.step_stats.fit.model(max_num_batched_tokens=args.budget)
    print(f"fit workload: {n} passes in {time.perf_counter() - started:.1f} s; window {fitted.num_samples} samples")
    for name, m in {"calibrated": calibrated, "fitted": fitted}.items():
        print(f"  {name:<10} base {m.base_s * 1e3:.2f} ms, {m.per_token_s * 1e6:.1f} us/token, "
              f"{m.per_seq_s * 1e6:.1f} us/seq, {m.per_attn_s * 1e6:.2f} us per 1k attention pairs")

    models = Models(engine, calibrated, fitted)
    system = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])
    system = list(system["input_ids"] if hasattr(system, "keys") else system)
    rows = heldout_steps(engine, models, held[: args.num_heldout], args.max_tokens)
    rows += heldout_prefills(engine, models, held[args.num_heldout:], system)
    rows += decode_batches(engine, models, held, [1, 4, 16, 32])
    report(rows)
    online = engine.stats().cost_model
    print(f"  online at the end: base {online.base_s * 1e3:.2f} ms, {online.per_token_s * 1e6:.1f} us/token, "
          f"{online.per_seq_s * 1e6:.1f} us/seq, {online.per_attn_s * 1e6:.2f} us per 1k attention pairs")
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1-min)")


if __name__ == "__main__":
    main()
