"""Per-request sampling parameters: each field declared once, with its default and its range.

Every other form of a sampling field derives from this class, field by field and by name:

- the OpenAI request bodies (``router/api/openai_requests.py``) accept each field under its own
  name and type (a tuple as a JSON list), null meaning the default;
- the wire message ``tandem.v1.SamplingParams`` (``proto/tandem/v1/common.proto``) carries each
  field under its own name; ``core/proto_convert.py`` converts by name, and
  ``tests/unit/core/test_proto_convert.py`` fails when the two field lists disagree;
- the engine reads the object itself (``engine.outputs.SamplingInput``).

So a new sampling field is declared and checked here, added to ``common.proto`` (then
``make protos``) and applied in ``engine/sampler.py``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from core.structured_output import StructuredOutputSpec

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs
DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class SamplingParamsError(ValueError):
    """A sampling field out of its range: ``param`` names the field, the message quotes the value."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each generated token.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 or -1 keeps every token.
        min_p: in [0, 1]; drop every token whose probability (at the temperature) is below
            ``min_p`` times the most likely token's (vLLM's min_p); 0 keeps every token.
        seed: per-request seed; with it the request's tokens do not depend on its batch.
        max_tokens: upper bound on generated tokens (>= 1), the first token included.
        min_tokens: EOS and ``stop_token_ids`` neither end the request nor get sampled before
            this many tokens were generated (0..max_tokens).
        stop_token_ids: tokens that end generation (in addition to EOS); they are returned.
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: None returns no log-probabilities; k in [0, 20] returns the sampled token's
            and the k most likely tokens' (0: the sampled token's only).
        prompt_logprobs: None returns none; k in [0, 20] returns each prompt token's (from the
            second on: the first has no context) and the k most likely tokens' at its position.
            The prompt is then computed whole (no prefix-cache or pool hit).
        presence_penalty: subtracted once from the logit of every token already generated
            ([-2, 2], OpenAI).
        frequency_penalty: subtracted from a token's logit once per time it was generated
            ([-2, 2], OpenAI).
        repetition_penalty: > 0 and finite; a token of the prompt or the output has its logit
            divided by it when positive, multiplied when negative (CTRL / vLLM); 1 disables.

    Raises:
        SamplingParamsError: on any out-of-range value, naming the field and quoting the value.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured_outputs: StructuredOutputSpec | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):  # an integer is a valid float
            if f.type in ("float", float):
                object.__setattr__(self, f.name, float(getattr(self, f.name)))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        # In the order a request's fields are reported; NaN fails every range.
        if not self.max_tokens >= 1:
            raise SamplingParamsError("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise SamplingParamsError("temperature", f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise SamplingParamsError("top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise SamplingParamsError("seed", f"seed must be in [0, 2**64), got {self.seed}")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise SamplingParamsError(name, f"{name} must be in [-2, 2], got {value}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError(
                "repetition_penalty", f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError("logprobs", f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputSpec):
                raise SamplingParamsError("structured_outputs", "structured_outputs must be a StructuredOutputSpec")
            if self.ignore_eos:
                raise SamplingParamsError("ignore_eos", "ignore_eos cannot be combined with a structured output "
                                          "(the grammar ends the output with EOS)")
            if self.min_tokens:
                raise SamplingParamsError("min_tokens", f"min_tokens must be 0 with a structured output "
                                          f"(the grammar decides where the output ends), got {self.min_tokens}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingParamsError(
                "prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )

    @classmethod
    def from_optional(cls, **fields: Any) -> SamplingParams:
        """``SamplingParams(**fields)`` where None means the field's default: a field a request
        body left out or sent as null, an optional wire field left unset.

        Raises:
            SamplingParamsError: a value out of its range.
        """
        return cls(**{name: value for name, value in fields.items() if value is not None})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))  # in declaration order
