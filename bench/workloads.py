"""Workloads: what each benchmark request asks for (prompt, output length, trace arrival time).

Prompt sets (ShareGPT, AlpacaEval JSON) give text prompts sent as chat messages with a fixed
``max_tokens``; traces (Mooncake, Azure, BurstGPT) give synthesized token-id prompts of exact
length, sent to ``/v1/completions``, with the trace's own output lengths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from bench.synthesis import PrefixSynthesizer, SynthesisConfig
from bench.traces import read_trace
from bench.prompts import BUILTIN_PROMPTS, load_prompts

PROMPT_SET_KINDS = ("sharegpt", "alpaca", "prompts")
TRACE_KINDS = ("mooncake", "azure", "burstgpt")


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]  # text: a chat message; ints: completion prompt token ids (exact length)
    max_tokens: int
    arrival_s: float | None = None  # trace time of arrival, before time scaling; None: not a trace
    expected_input_tokens: int | None = None  # known for token-id prompts


@dataclass(frozen=True)
class WorkloadConfig:
    kind: str  # sharegpt | alpaca | prompts (any prompt JSON/text file) | mooncake | azure | burstgpt
    path: Path | None  # None: prompt sets use the built-in prompts (bench.prompts), repeated
    num_requests: int = 0  # 0: every row
    max_tokens: int = 0  # prompt sets: required; traces: 0 keeps the trace's output lengths
    max_prompt_chars: int = 2000  # prompt sets: longer prompts are skipped
    max_total_tokens: int = 0  # traces: rows whose scaled input + output exceed this are skipped; 0: none
    synthesis: SynthesisConfig = field(default_factory=SynthesisConfig)

    def __post_init__(self) -> None:
        if self.kind not in PROMPT_SET_KINDS + TRACE_KINDS:
            raise ValueError(f"unknown workload kind {self.kind!r}; expected one of {PROMPT_SET_KINDS + TRACE_KINDS}")
        if self.kind in PROMPT_SET_KINDS and self.max_tokens <= 0:
            raise ValueError(f"a prompt set needs max_tokens > 0, got {self.max_tokens}")
        if self.kind in TRACE_KINDS and self.path is None:
            raise ValueError(f"the {self.kind} workload needs a trace file (--path)")
        if self.num_requests < 0 or self.max_tokens < 0 or self.max_total_tokens < 0:
            raise ValueError(f"counts must be >= 0: {self.num_requests}, {self.max_tokens}, {self.max_total_tokens}")


def load_workload(config: WorkloadConfig) -> list[BenchRequest]:
    """Reads ``config.path``; returns at most ``num_requests`` requests in file order (without a
    path, ``num_requests`` built-in prompts, repeated in turn: prefix caching then hits)."""
    limit = config.num_requests or 10**9
    if config.kind in PROMPT_SET_KINDS and config.path is None:
        count = config.num_requests or len(BUILTIN_PROMPTS)
        return [BenchRequest(BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)], config.max_tokens) for i in range(count)]
    if config.kind in PROMPT_SET_KINDS:
        prompts = load_prompts(Path(config.path), limit, max_chars=config.max_prompt_chars)
        return [BenchRequest(p, config.max_tokens) for p in prompts]
    synthesizer = PrefixSynthesizer(config.synthesis)
    requests = []
    for index, row in enumerate(read_trace(Path(config.path), config.kind)):
        if len(requests) >= limit:
            break
        output_tokens = config.max_tokens or config.synthesis.scale_output(row.output_tokens)
        input_tokens = config.synthesis.scale_input(row.input_tokens)
        if config.max_total_tokens and input_tokens + output_tokens > config.max_total_tokens:
            continue
        prompt = synthesizer.prompt(row, index)
        requests.append(BenchRequest(prompt, output_tokens, row.arrival_s, len(prompt)))
    return requests
