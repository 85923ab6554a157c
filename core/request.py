"""A generation request as every scheduler sees it: token counts, not phases (docs/design.md §7)."""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from core.sampling_params import SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request stopped; the values are the OpenAI API's."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the system


# The one rule that ends a request on a token. Both sides apply it to the same tokens: the
# engine (Request.append_output_token) to free a finished request's blocks at the step that ends
# it, and the router (router.output.processor.OutputProcessor) because the first token comes from a
# prefill worker, which does not say whether it ends the request, and because a resumed
# (migrated) stream must end at the same token. Stop *strings* are the router's alone (they need
# the tokenizer; router.output.stop_strings).


def stop_token_ids(params: SamplingParams, eos_token_ids: Iterable[int]) -> frozenset[int]:
    """Tokens that end the request once past ``min_tokens``: the EOS tokens unless
    ``ignore_eos``, and ``params.stop_token_ids``."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return frozenset((*eos, *params.stop_token_ids))


def stop_reason(params: SamplingParams, stop_ids: frozenset[int], token_id: int,
                num_output_tokens: int) -> FinishReason | None:
    """Why the request ends at ``token_id``, its ``num_output_tokens``-th output token (this
    one counted), or None when it goes on. The ending token is part of the output.

    STOP: ``token_id`` is in ``stop_ids`` (see :func:`stop_token_ids`) and more than
    ``params.min_tokens`` tokens were generated; LENGTH: ``params.max_tokens`` were generated.
    STOP wins when both hold.
    """
    if num_output_tokens > params.min_tokens and token_id in stop_ids:
        return FinishReason.STOP
    if num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence moving ``num_computed_tokens`` toward ``num_tokens``.

    Prefill, a prefix-cache hit and KV loaded from the pool are all ways ``num_computed_tokens``
    grows; each step that reaches ``num_tokens`` samples one new token.

    ::

        all_token_ids:  [ prompt ............................ | output ....... ]
                        |<-- num_computed_tokens (KV exists) -->|<- to compute ->|
                                                                          num_tokens
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time_s: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in this worker's cache.
    num_computed_tokens: int = 0
    # Prompt tokens whose KV was loaded (pool or prefix cache) instead of computed.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Tokens that end the request (once past ``min_tokens``): EOS unless ignored, and
        ``stop_token_ids``."""
        return stop_token_ids(self.sampling_params, () if self.eos_token_id is None else (self.eos_token_id,))

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output_token(self, token_id: int) -> FinishReason | None:
        """Appends a sampled token; finishes the request and returns why if it must stop.

        The rule is :func:`stop_reason` (the router applies the same one): EOS and stop
        tokens at output index < ``min_tokens`` do not stop it (the sampler masks them there
        too). Mutates ``output_token_ids``, and ``status``/``finish_reason`` when it stops.
        """
        self.output_token_ids.append(token_id)
        reason = stop_reason(self.sampling_params, self.stop_token_ids, token_id, self.num_output_tokens)
        if reason is not None:
            self.finish(reason)
        return reason

    def finish(self, reason: FinishReason) -> None:
        """Marks the request finished (idempotent: the first reason wins)."""
        if self.status is not RequestStatus.FINISHED:
            self.status = RequestStatus.FINISHED
            self.finish_reason = reason
