"""Measures each scheduling technique on this machine, side by side in one run (issue: the seed's
scheduling techniques). Engine-level (no RPC), real model, real prompts; prints one table.

    python benchmarks/scheduling.py [--prompts PATH] [--num-prompts 200] [--max-tokens 32] [--quick]

1. continuous vs static batching: requests/s and output tokens/s on N ShareGPT prompts;
2. TBT p50/p99 of running decodes while long prompts arrive, with and without chunked prefill;
3. the scheduler's share of step time ((wall - forward busy) / wall) with overlap off and on;
4. throughput with num_scheduler_steps 1 / 4 / 8;
5. prefix-cache hit rate and prefill tokens saved on a shared-prefix workload.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from bench.prompts import BUILTIN_PROMPTS, load_prompts  # noqa: E402
from core.datasets import data_file  # noqa: E402

SHAREGPT_DEFAULT = data_file("sharegpt")  # the data folder's ShareGPT set (docs/data.md)

MAX_MODEL_LEN = 4608


class Bench:
    def __init__(self, num_threads: int):
        import torch

        torch.set_num_threads(num_threads)
        self.source = resolve_model(DEFAULT_MODEL)
        hf_dir = ensure_hf_dir(self.source)
        self.model = load_model(hf_dir, "float32", "cpu", MAX_MODEL_LEN)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(hf_dir)

    def ids(self, text: str) -> list[int]:
        ids = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def engine(self, **overrides) -> LLMEngine:
        config = dict(block_size=16, num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=2048,
                      max_model_len=MAX_MODEL_LEN)
        return LLMEngine(EngineConfig(**{**config, **overrides}), self.model, self.source)

    @staticmethod
    def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str, spread: bool = False) -> dict:
        """All prompts queued at once; returns throughput and the scheduler's share of wall time.

        ``spread``: output lengths vary from 1 to 2 x max_tokens - 1 (a fixed pseudo-random
        pattern, mean max_tokens), as real answers do; EOS is ignored so lengths are exact.
        """
        for i, p in enumerate(prompts):
            length = 1 + (i * 37) % (2 * max_tokens - 1) if spread else max_tokens
            engine.add_request(Request(f"{tag}-{i}", p, SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)))
        busy0 = engine.runner.busy_time_s
        started = time.perf_counter()
        num_tokens = 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
        wall = time.perf_counter() - started
        busy = engine.runner.busy_time_s - busy0
        return {"wall_s": wall, "req_s": len(prompts) / wall, "tok_s": num_tokens / wall,
                "sched_share": max(0.0, (wall - busy) / wall)}


def tbt_under_long_prompts(bench: Bench, chunked: bool, long_len: int, num_decodes: int) -> dict:
    """Running decodes' inter-token gaps while two long prompts arrive mid-stream."""
    budget = 256 if chunked else MAX_MODEL_LEN
    engine = bench.engine(max_num_batched_tokens=budget, enable_chunked_prefill=chunked, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i in range(num_decodes):
        engine.add_request(Request(f"d{i}", bench.ids(BUILTIN_PROMPTS[i % 8]), params))
    last: dict[str, float] = {}
    gaps: list[float] = []
    steady: list[float] = []
    step = 0
    long_prompt = (bench.ids(" ".join(BUILTIN_PROMPTS) * 200))[:long_len]
    for outputs in engine.step_stream():  # one forward pass per iteration
        now = time.perf_counter()
        for o in outputs:
            if o.request_id.startswith("d"):
                if o.request_id in last:
                    (gaps if step >= 6 else steady).append(now - last[o.request_id])
                last[o.request_id] = now
        step += 1
        if step in (6, 14):  # long prompts arrive while the decodes run
            engine.add_request(Request(f"long{step}", long_prompt, SamplingParams(temperature=0, max_tokens=1)))
    q = statistics.quantiles(gaps, n=100)
    return {"p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000, "steady_ms": statistics.median(steady) * 1000}


def prefix_workload(bench: Bench, enable: bool, n: int) -> dict:
    system = "You are a helpful assistant for a company that sells bicycles. " * 8
    prompts = []
    for text in BUILTIN_PROMPTS[:n]:
        ids = bench.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    engine = bench.engine(enable_prefix_caching=enable)
    prompt_tokens = 0
    for i, p in enumerate(prompts):  # one after another: each can reuse the earlier ones' blocks
        prompt_tokens += len(p)
        bench.run(engine, [p], 4, f"pfx{i}")
    kv = engine.scheduler.kv
    return {"hit_rate": kv.num_prefix_hit_tokens / max(1, kv.num_prefix_queries_tokens),
            "saved_tokens": kv.num_prefix_hit_tokens, "prompt_tokens": prompt_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=Path, default=SHAREGPT_DEFAULT if SHAREGPT_DEFAULT.exists() else None)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--long-prompt-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="32 prompts, 16 tokens, 1k-token long prompts")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.max_tokens, args.long_prompt_tokens = 32, 16, 1024
    bench = Bench(args.threads)
    texts = load_prompts(args.prompts, args.num_prompts, max_chars=1500)
    prompts = [bench.ids(t)[:1024] for t in texts]
    print(f"{len(prompts)} prompts ({args.prompts or 'built-in'}), output lengths 1..{2 * args.max_tokens - 1} "
          f"(mean {args.max_tokens}), batches of {args.max_num_seqs}, {args.threads} threads")
    rows: list[tuple[str, ...]] = []
    results = {}

    def emit(row: tuple[str, ...]) -> None:
        rows.append(row)
        print("  ".join(row), flush=True)

    # Batches of --max-num-seqs over more requests than that, with output lengths that differ:
    # where static batching idles finished slots until a batch's longest request ends.
    for name, overrides in [("static", {"scheduling_policy": "static"}), ("continuous", {}),
                            ("continuous steps=4", {"num_scheduler_steps": 4}),
                            ("continuous steps=8", {"num_scheduler_steps": 8}),
                            ("continuous overlap", {"enable_overlap": True})]:
        engine = bench.engine(enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, **overrides)
        r = bench.run(engine, prompts, args.max_tokens, name, spread=True)
        results[name] = r
        emit((name, f"{r['req_s']:.2f} req/s", f"{r['tok_s']:.1f} tok/s", f"sched share {r['sched_share']:.1%}"))
    base = results["static"]
    emit(("continuous / static", f"{results['continuous']['req_s'] / base['req_s']:.2f}x",
                 f"{results['continuous']['tok_s'] / base['tok_s']:.2f}x", ""))
    for chunked in (False, True):
        t = tbt_under_long_prompts(bench, chunked, args.long_prompt_tokens, num_decodes=8)
        emit((f"TBT with {args.long_prompt_tokens}-token arrivals, chunked={chunked}",
                     f"p50 {t['p50_ms']:.0f} ms", f"p99 {t['p99_ms']:.0f} ms",
                     f"steady {t['steady_ms']:.0f} ms (p99/steady {t['p99_ms'] / t['steady_ms']:.2f})"))
    for enable in (False, True):
        p = prefix_workload(bench, enable, 8)
        emit((f"shared-prefix workload, prefix cache={enable}", f"hit rate {p['hit_rate']:.1%}",
                     f"prefill tokens saved {p['saved_tokens']}/{p['prompt_tokens']}", ""))
    width = max(len(r[0]) for r in rows)
    print()
    for r in rows:
        print(f"{r[0]:<{width}}  " + "  ".join(f"{c:<18}" for c in r[1:]))


if __name__ == "__main__":
    main()
