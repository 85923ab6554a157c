"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each generated token.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 or -1 keeps every token.
        seed: per-request seed; with it the request's tokens do not depend on its batch.
        max_tokens: upper bound on generated tokens (>= 1), the first token included.
        min_tokens: EOS and ``stop_token_ids`` neither end the request nor get sampled before
            this many tokens were generated (0..max_tokens).
        stop_token_ids: tokens that end generation (in addition to EOS); they are returned.
        ignore_eos: keep generating past EOS (benchmarks).
        logprobs: None returns no log-probabilities; k in [0, 20] returns the sampled token's
            and the k most likely tokens' (0: the sampled token's only).
        presence_penalty: subtracted once from the logit of every token already generated
            ([-2, 2], OpenAI).
        frequency_penalty: subtracted from a token's logit once per time it was generated
            ([-2, 2], OpenAI).
        repetition_penalty: > 0; a token of the prompt or the output has its logit divided by
            it when positive, multiplied when negative (CTRL / vLLM); 1 disables.

    Raises:
        ValueError: on any out-of-range value, quoting it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
