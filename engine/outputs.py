"""Plain data passed between Scheduler, ModelRunner and the engine's callers (vLLM v1 style)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from core.cost_model import StepSample
from core.request import FinishReason
from core.sampling_params import SamplingParams


PLACEHOLDER_TOKEN_ID = -1  # a token being sampled by a step still running (overlap scheduling)


@dataclass(frozen=True)
class ExternalKV:
    """KV of a request's first ``num_tokens`` tokens, fetched from outside (the pool) before the
    request reaches the engine: one payload per block, ``[num_layers, 2, block_size, num_kv_heads,
    head_dim]`` bytes each, ``ceil(num_tokens / block_size)`` of them."""

    num_tokens: int
    payloads: list[bytes | memoryview]

    def let_go(self) -> None:
        """The payloads will not be copied (a prefix-cache hit covers them, the request was
        aborted or refused): their pool views go now. See :func:`let_go`."""
        let_go(self.payloads)


def let_go(payloads: Sequence[object]) -> None:
    """Runs the load guard of every pool view among ``payloads`` now (each
    ``engine.kv_connector.ArenaBlock`` carries one ``LoadGuard``, shared by one fetch; plain bytes
    carry none): copied, or never to be. Waiting for the views to be garbage instead can take until
    the next cyclic collection (an exception's traceback, or a cancelled stream's frame, holding
    them), which an idle worker may never run, its pool leases renewed all along. Duck-typed on
    ``.guard`` so that this module (and the scheduler, which the simulator runs) imports no torch.
    """
    guards = {}
    for payload in payloads:
        guard = getattr(payload, "guard", None)
        if guard is not None:
            guards[id(guard)] = guard
    for guard in guards.values():
        guard.done()


@dataclass(frozen=True)
class SamplingInput:
    """What the sampler reads of a request whose step samples, copied at schedule time (the
    request itself moves on while the step runs under overlap scheduling)."""

    request_id: str
    sampling_params: SamplingParams
    # Index of the token being sampled: its seed input, and what min_tokens compares with.
    num_output_tokens: int
    # Tokens that end the request once past min_tokens (Request.stop_token_ids).
    stop_token_ids: frozenset[int]
    # The prompt (shared: never mutated) and, only when penalties apply, a copy of the outputs
    # so far (its last entry may be PLACEHOLDER_TOKEN_ID until PreparedStep.patch).
    prompt_token_ids: list[int]
    output_token_ids: list[int]


@dataclass(frozen=True)
class PromptLogprobsInput:
    """A step's share of a request's prompt logprobs: the logits of the step's first
    ``len(target_token_ids)`` tokens of the request give the log-probabilities of
    ``target_token_ids`` (the prompt token after each), with the ``num_top`` best tokens."""

    target_token_ids: list[int]
    num_top: int


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step, as plain data: compute ``token_ids`` at positions
    ``[num_computed_tokens, num_computed_tokens + num_new_tokens)`` into ``block_ids``.
    Copied from the request at schedule time (vLLM v1's NewRequestData / CachedRequestData)."""

    request_id: str
    # The step's input tokens, all_token_ids[num_computed_tokens : + num_new_tokens]; under
    # overlap scheduling the last may be PLACEHOLDER_TOKEN_ID (sampled by the step still running).
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    # Set when this step reaches the request's last token, so a new token is sampled.
    sampling: SamplingInput | None = None
    # Set when the request asked for prompt logprobs and this step computes prompt positions.
    prompt_logprobs: PromptLogprobsInput | None = None

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def samples(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True)
class KVLoad:
    """Payloads to write into ``block_ids`` before the forward pass."""

    block_ids: list[int]
    payloads: list[bytes | memoryview]


@dataclass(frozen=True)
class SwapOut:
    """A preempted request whose KV is to be swapped out: ``block_ids`` (already freed) hold its
    first ``num_tokens`` tokens until the next step runs; the engine packs them before that."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    # (src, dst) block copies (copy-on-write) to run before the loads and the forward pass.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Requests preempted (blocks freed, back to waiting) while building this step.
    preempted_request_ids: list[str] = field(default_factory=list)
    # Of those, the ones whose KV is to be swapped out rather than recomputed.
    swap_outs: list[SwapOut] = field(default_factory=list)
    # Requests this step admits from waiting (their first chunk, or their first token after KV
    # loaded from the pool): LLMEngine.on_pass_start hears of them before the forward pass.
    admitted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class SampledToken:
    """One sampled token; the log-probabilities are filled only when the request asked for them."""

    token_id: int
    # log-probability of token_id under the (penalised, temperature-free) distribution.
    logprob: float | None = None
    # The request's top_logprobs most likely (token_id, logprob) pairs, best first.
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass
class ModelRunnerOutput:
    # request_id -> sampled token, for requests whose step reached their last token.
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # request_id -> the logprobs of the prompt tokens this step's positions predict, in order.
    prompt_logprobs: dict[str, list[SampledToken]] = field(default_factory=dict)
    # What the pass computed and its forward + sampling wall time (duration_s; the engine widens
    # it to the whole pass, see LLMEngine._record); None for an empty pass.
    step_sample: StepSample | None = None


@dataclass
class RequestOutput:
    """What a step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_cached_tokens: int = 0
    # Filled for finished requests when the engine saves KV on finish (prefill workers):
    # one payload per block covering the prompt, in order.
    saved_kv: list[bytes] | None = None
    # Set when the engine refused the request (e.g. it cannot fit max_model_len).
    error: str | None = None
    # One entry per new token when the request asked for logprobs.
    logprobs: list[SampledToken] = field(default_factory=list)
    # With its first token, when the request asked for prompt logprobs: prompt tokens 1.. in order.
    prompt_logprobs: list[SampledToken] | None = None
    # A marker with no tokens: the pass that admits the request has begun (its next token ends
    # it). Sent only to callers that asked (AsyncEngine.generate's ``notify_start``).
    started: bool = False
