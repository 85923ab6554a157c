"""Baseline: Hugging Face transformers static batching (``generate()`` on left-padded batches).

The only torch user in ``bench``; torch and transformers are imported inside the functions so that
the rest of the package (and ``tandem bench``) stays torch-free.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.client import RequestRecord


@dataclass(frozen=True)
class HFBaselineConfig:
    model_dir: Path  # a Hugging Face folder (safetensors + tokenizer)
    batch_size: int = 8
    max_tokens: int = 32  # every request generates exactly this many tokens (EOS ignored)
    num_threads: int = 0  # torch intra-op threads; 0: every core

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_tokens < 1 or self.num_threads < 0:
            raise ValueError(f"batch_size and max_tokens must be >= 1, num_threads >= 0: "
                             f"{self.batch_size}, {self.max_tokens}, {self.num_threads}")


def chat_token_ids(model_dir: Path, prompts: list[str]) -> list[list[int]]:
    """Each prompt as one user turn through the model's chat template, ready for generation."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                               tokenize=True, return_dict=False))
            for p in prompts]


def run_static(prompts: list[list[int]], config: HFBaselineConfig,
               on_batch: Callable[[int, int], None] = lambda done, total: None) -> dict:
    """Greedy ``generate()`` over consecutive batches of ``batch_size`` prompts, in order.

    Returns the request and output-token throughput over the generation time (model loading
    excluded), the mean time of one batched step (prefill included), and per batch its start and
    the moment each generated token reached the host (``batches``, seconds after the run started;
    :func:`static_records` turns them into per-request records). ``on_batch(done, total)`` is
    called after each batch with prompt counts.
    """
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(config.num_threads or os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=torch.float32).eval()
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    output_tokens = 0
    batches: list[dict] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), config.batch_size):
            input_ids, attention_mask = _left_pad(prompts[first:first + config.batch_size], pad_id)
            clock = _StepClock(start)
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                 max_new_tokens=config.max_tokens, min_new_tokens=config.max_tokens,
                                 pad_token_id=pad_id, streamer=clock)
            output_tokens += (out.shape[1] - input_ids.shape[1]) * input_ids.shape[0]
            batches.append({"first_prompt": first, "num_prompts": input_ids.shape[0], "start_s": clock.start_s,
                            "token_times_s": clock.token_times_s})
            on_batch(min(first + config.batch_size, len(prompts)), len(prompts))
    duration_s = time.perf_counter() - start
    num_batches = -(-len(prompts) // config.batch_size)
    return {
        "num_requests": len(prompts),
        "duration_s": duration_s,
        "request_throughput_rps": len(prompts) / duration_s,
        "output_throughput_tps": output_tokens / duration_s,
        "mean_step_ms": 1000 * duration_s / (num_batches * config.max_tokens),
        "batch_size": config.batch_size,
        "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts),
        "batches": batches,
    }


def static_records(result: dict, prompts: list[list[int]]) -> list[RequestRecord]:
    """One record per prompt of a :func:`run_static` result, as if a closed-loop client with
    ``batch_size`` slots had sent each batch the moment the previous one ended: TTFT is the
    batch's prefill, and every request of a batch shares the batch's token times."""
    records = []
    for batch in result["batches"]:
        chunk_times_s = [t - batch["start_s"] for t in batch["token_times_s"]]
        for index in range(batch["first_prompt"], batch["first_prompt"] + batch["num_prompts"]):
            records.append(RequestRecord(index, batch["start_s"], ttft_s=chunk_times_s[0], chunk_times_s=chunk_times_s,
                                         e2e_s=chunk_times_s[-1], prompt_tokens=len(prompts[index]),
                                         output_tokens=len(chunk_times_s), finish_reason="length"))
    return records


class _StepClock:
    """A ``generate()`` streamer that only notes when each step's tokens reach the host.

    ``generate`` first puts the prompt (at the batch's start), then one ``[batch]`` tensor of new
    tokens per step. Times are seconds after ``run_start``.
    """

    def __init__(self, run_start: float):
        self.run_start = run_start
        self.start_s = time.perf_counter() - run_start
        self.token_times_s: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if self._seen_prompt:
            self.token_times_s.append(time.perf_counter() - self.run_start)
        self._seen_prompt = True

    def end(self) -> None:
        pass


def _left_pad(batch: list[list[int]], pad_id: int):
    """[batch, longest] int64 ids and mask, padded on the left so every row ends at the last column."""
    import torch

    width = max(map(len, batch))
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, tokens in enumerate(batch):
        ids[row, width - len(tokens):] = torch.tensor(tokens)
        mask[row, width - len(tokens):] = 1
    return ids, mask
