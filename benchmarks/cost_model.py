"""How well a worker's fitted cost model (core.cost_model) predicts its own steps (issue 7, part 2).

Engine-level (no RPC), real model, real prompts (ShareGPT from ../shared/data, or synthetic
lengths without it). Prints the fitted coefficients and the mean absolute % error (MAPE) of:

1. held-out steps of a mixed workload (prefill-only, decode-only and mixed passes), step_s vs the
   measured forward time;
2. held-out requests' prefill alone on the worker, prefill_s(uncached, cached) vs the wall time
   of the passes (prompts with and without a cached shared prefix);
3. decode passes of batches of 1..32 sequences, decode_step_s(batch, kv_tokens) vs wall time;

each for the model right after start-up calibration (what the router sees first) and after the
model was fitted on a separate mixed workload.

    python benchmarks/cost_model.py [--prompts PATH] [--num-fit 32] [--num-heldout 12] [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
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
from engine.loader import ensure_hf_dir  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from launcher.prompts import SHAREGPT_DEFAULT, load_prompts  # noqa: E402

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


def heldout_steps(engine: LLMEngine, prompts, max_tokens: int, models: dict[str, CostModel]) -> dict:
    kinds: dict[str, list] = {"prefill": [], "decode": [], "mixed": []}
    for s in mixed_workload(engine, prompts, max_tokens, "steps"):
        kind = "decode" if s.num_new_tokens == s.num_seqs else "prefill" if s.num_seqs == 1 else "mixed"
        kinds[kind].append(s)
    return {name: {kind: (mape([(m.step_s(s.num_new_tokens, s.num_seqs, s.attn_pairs), s.duration_s) for s in ss]),
                          len(ss)) for kind, ss in kinds.items()} for name, m in models.items()}


def heldout_prefills(engine: LLMEngine, prompts, system: list[int]) -> list[tuple[str, int, int, float]]:
    """(kind, uncached, cached, wall_s) of each prompt prefilled alone ("plain": only the chat
    template's few shared tokens may be cached), then after a cached shared system prompt
    ("shared"; prefix cache on, warmed first)."""
    rows = []
    engine.add_request(Request("warm", system + prompts[0], SamplingParams(temperature=0, max_tokens=1)))
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        for tag, ids in (("plain", p), ("shared", system + p)):
            engine.add_request(Request(f"pf-{tag}-{i}", ids, SamplingParams(temperature=0, max_tokens=1)))
            started, cached = time.perf_counter(), 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    cached = o.num_cached_tokens
            rows.append((tag, len(ids) - cached, cached, time.perf_counter() - started))
    return rows


def decode_batches(engine: LLMEngine, prompts, sizes: list[int]) -> list[tuple[int, int, float]]:
    """(batch, kv_tokens, wall_s) of decode passes of each batch size."""
    rows = []
    for b in sizes:
        for i in range(b):
            p = prompts[i % len(prompts)][:200]
            engine.add_request(Request(f"dec{b}-{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
        last = time.perf_counter()
        kv = 0
        for _ in engine.step_stream():
            now, s = time.perf_counter(), engine.step_stats.last
            if s.num_new_tokens == s.num_seqs == b:
                rows.append((b, kv, now - last))
            kv = sum(r.num_computed_tokens for r in engine.scheduler.running)  # the next pass attends this
            last = now
    return rows


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
                          max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
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
    models = {"calibrated": calibrated, "fitted": fitted}
    for name, m in models.items():
        print(f"  {name:<10} base {m.base_s * 1e3:.2f} ms, {m.per_token_s * 1e6:.1f} us/token, "
              f"{m.per_seq_s * 1e6:.1f} us/seq, {m.per_attn_s * 1e6:.2f} us per 1k attention pairs")

    steps = heldout_steps(engine, held[: args.num_heldout], args.max_tokens, models)
    cache_engine = LLMEngine(dataclasses.replace(config, num_kv_blocks=256, enable_prefix_caching=True), model, source)
    system = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}])
    system = list(system["input_ids"] if hasattr(system, "keys") else system)
    prefills = heldout_prefills(cache_engine, held[args.num_heldout:], system)
    decodes = decode_batches(engine, held, [1, 4, 16, 32])
    print("\nMAPE (mean absolute % error) on held-out data".ljust(54) + "calibrated    fitted   (n)")
    for kind, label in (("prefill", "prefill-only"), ("decode", "decode-only"), ("mixed", "mixed")):
        print(f"  step_s vs forward time, {label} passes".ljust(54) +
              f"{steps['calibrated'][kind][0]:8.1f}% {steps['fitted'][kind][0]:8.1f}%   ({steps['fitted'][kind][1]})")
    for tag, label in (("plain", "own prompt"), ("shared", "after a cached system prompt")):
        rows = [r for r in prefills if r[0] == tag]
        errs = [mape([(m.prefill_s(u, c), wall) for _, u, c, wall in rows]) for m in models.values()]
        print(f"  prefill_s vs wall, {label}".ljust(54) + f"{errs[0]:8.1f}% {errs[1]:8.1f}%   ({len(rows)})")
    for b in sorted({r[0] for r in decodes}):
        rows = [r for r in decodes if r[0] == b]
        errs = [mape([(m.decode_step_s(b, kv), wall) for _, kv, wall in rows]) for m in models.values()]
        print(f"  decode_step_s vs wall, batch {b}".ljust(54) + f"{errs[0]:8.1f}% {errs[1]:8.1f}%   ({len(rows)})")
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1-min)")


if __name__ == "__main__":
    main()
