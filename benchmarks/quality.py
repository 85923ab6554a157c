"""Output quality of reduced-precision weights and KV blocks against float32, on the real model,
through the engine.

    .venv/bin/python benchmarks/quality.py --path alpaca_eval_805_gpt4_1106_preview_outputs.json \\
        [--variants float32,bfloat16,int8,w8a16,kv-fp8,kv-int8] [--num-prompts 32] [--answer-tokens 256] [--greedy-tokens 32]

``--path``: AlpacaEval's reference outputs (a JSON array of ``{"instruction", "output"}``; the
``alpaca`` data set of docs/data.md). For each of the first ``--num-prompts`` rows, every variant
(an engine configuration: :data:`VARIANTS`) computes:

- **perplexity of the reference answer**: the instruction as a one-turn chat prompt followed by the
  first ``--answer-tokens`` tokens of GPT-4's answer, run as one prompt with ``prompt_logprobs``;
  ``exp`` of the mean negative log-likelihood of the answer tokens (all prompts pooled);
- **greedy agreement**: the share of prompts whose first ``--greedy-tokens`` greedy tokens
  (fewer where generation ends at EOS) equal the reference variant's (the first one), and the
  mean number of tokens before the first difference.

Prints a markdown table (and writes it with the per-prompt numbers as JSON). Every variant runs
the same requests in the same batches, so each differs from the reference by its precision only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402

# Variant name -> EngineConfig fields: weight dtypes, then KV-cache dtypes (float32 weights,
# 8-bit K/V with a scale per token and head: docs/quantization.md).
VARIANTS: dict[str, dict] = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "float16": dict(dtype="float16"),
    # int8 weights; the attention output's and the MLP gate/up's activations rounded to 8 bits per row
    "int8": dict(dtype="float32", quantization="int8"),
    # int8 weights, every activation at 16 bits or more (weight-only)
    "w8a16": dict(dtype="float32", quantization="w8a16"),
    # w8a16 through Tandem's kernel alone (with AVX512-VNNI: activations rounded to int16 per row)
    "w8a16-cpu": dict(dtype="float32", quantization="w8a16", linear_backend="int8_cpu"),
    # w8a16 through oneDNN's u8 x s8 GEMM, activations split into two bytes (AMX or VNNI CPUs only)
    "w8a16-onednn": dict(dtype="float32", quantization="w8a16", linear_backend="int8_onednn"),
    "kv-fp8": dict(dtype="float32", kv_cache_dtype="fp8"),
    "kv-int8": dict(dtype="float32", kv_cache_dtype="int8"),
}


@dataclass
class Sample:
    prompt_ids: list[int]  # the one-turn chat prompt, generation prompt added
    answer_ids: list[int]  # the reference answer's first tokens


@dataclass
class VariantResult:
    name: str
    answer_logprobs: list[list[float]]  # per sample: log p of each answer token
    greedy: list[list[int]]  # per sample: the greedy tokens
    load_s: float
    run_s: float

    @property
    def perplexity(self) -> float:
        flat = [lp for row in self.answer_logprobs for lp in row]
        return math.exp(-sum(flat) / len(flat))


def read_samples(path: Path, num_prompts: int, answer_tokens: int, model: str) -> list[Sample]:
    """The first ``num_prompts`` rows of the AlpacaEval file, tokenised with the model's chat template.

    Raises:
        ValueError: the file is not a JSON array of objects with "instruction" and "output".
    """
    from transformers import AutoTokenizer

    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"instruction", "output"} <= set(r) for r in rows):
        raise ValueError(f"{path}: expected AlpacaEval's JSON array of {{'instruction', 'output'}} objects")
    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_dir(resolve_model(model)))
    samples = []
    for row in rows[:num_prompts]:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["instruction"]}],
                                               add_generation_prompt=True, tokenize=True)
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tokenizer(row["output"], add_special_tokens=False)["input_ids"][:answer_tokens]
        samples.append(Sample(prompt, answer))
    return samples


def run_all(engine: LLMEngine, requests: list[Request]) -> dict[str, list]:
    """Runs ``requests`` to completion together; request id -> prompt logprobs (when asked)."""
    logprobs: dict[str, list] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                logprobs[out.request_id] = out.prompt_logprobs
    return logprobs


def evaluate(name: str, overrides: dict, samples: list[Sample], args: argparse.Namespace) -> VariantResult:
    max_len = max(len(s.prompt_ids) + max(len(s.answer_ids), args.greedy_tokens) for s in samples) + 1
    started = time.perf_counter()
    config = EngineConfig(model=args.model, max_model_len=max(max_len, 256), num_kv_blocks=args.num_kv_blocks,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          num_threads=args.threads, **overrides)
    engine = LLMEngine.from_config(config)
    load_s, started = time.perf_counter() - started, time.perf_counter()
    scored = [Request(f"ppl-{i}", s.prompt_ids + s.answer_ids, SamplingParams(temperature=0, max_tokens=1,
                                                                              prompt_logprobs=0))
              for i, s in enumerate(samples)]
    logprobs = run_all(engine, scored)
    # prompt_logprobs[p] is the log-probability of prompt token p + 1: the answer's are the last ones.
    answer_logprobs = [[t.logprob for t in logprobs[f"ppl-{i}"][-len(s.answer_ids):]] for i, s in enumerate(samples)]
    greedy = [Request(f"greedy-{i}", s.prompt_ids, SamplingParams(temperature=0, max_tokens=args.greedy_tokens))
              for i, s in enumerate(samples)]
    run_all(engine, greedy)
    result = VariantResult(name, answer_logprobs, [list(r.output_token_ids) for r in greedy], load_s,
                           time.perf_counter() - started)
    engine.shutdown()
    return result


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table(results: list[VariantResult], args: argparse.Namespace) -> str:
    reference = results[0]
    lines = [f"| variant | perplexity | vs {reference.name} | greedy {args.greedy_tokens} tokens equal | "
             f"mean tokens before the first difference |", "|---|---:|---:|---:|---:|"]
    for r in results:
        equal = sum(a == b for a, b in zip(r.greedy, reference.greedy))
        prefix = sum(common_prefix(a, b) for a, b in zip(r.greedy, reference.greedy)) / len(r.greedy)
        change = 100 * (r.perplexity / reference.perplexity - 1)
        lines.append(f"| {r.name} | {r.perplexity:.3f} | {change:+.2f} % | {equal}/{len(r.greedy)} | {prefix:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--path", type=Path, required=True, help="AlpacaEval reference outputs (JSON array)")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--variants", default="float32,bfloat16,int8,w8a16,kv-fp8,kv-int8",
                        help="comma-separated, the first is the reference: " + ", ".join(VARIANTS))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--answer-tokens", type=int, default=256, help="reference answer tokens scored per prompt")
    parser.add_argument("--greedy-tokens", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/quality.json"))
    args = parser.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.num_prompts < 1 or args.answer_tokens < 1 or args.greedy_tokens < 1:
        parser.error("--num-prompts, --answer-tokens and --greedy-tokens must be >= 1")
    samples = read_samples(args.path, args.num_prompts, args.answer_tokens, args.model)
    results = []
    for name in names:
        results.append(evaluate(name, VARIANTS[name], samples, args))
        print(f"{name}: perplexity {results[-1].perplexity:.3f} (load {results[-1].load_s:.1f} s, "
              f"run {results[-1].run_s:.1f} s)", file=sys.stderr)
    print(f"{len(samples)} prompts, {sum(len(s.answer_ids) for s in samples)} reference answer tokens scored")
    print(table(results, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "table": table(results, args),
                                    "variants": [dict(name=r.name, perplexity=r.perplexity, load_s=r.load_s,
                                                      run_s=r.run_s, greedy=r.greedy) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
