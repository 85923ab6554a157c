"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to choose each generated token.

    Attributes:
        temperature: softmax temperature; 0 means greedy (argmax).
        top_p: nucleus sampling mass in (0, 1]; 1 keeps every token.
        top_k: keep the k most likely tokens; 0 or -1 keeps every token.
        seed: per-request seed; with it the request's tokens do not depend on its batch.
        max_tokens: upper bound on generated tokens (>= 1), the first token included.
        stop_token_ids: tokens that end generation (in addition to EOS); they are returned.
        ignore_eos: keep generating past EOS (benchmarks).

    Raises:
        ValueError: on any out-of-range value, quoting it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
