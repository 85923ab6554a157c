"""One request's output as the router builds it: finish checks, detokenization, stop strings."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from core.request import FinishReason, stop_reason, stop_token_ids
from core.sampling_params import SamplingParams
from router.output.detokenizer import IncrementalDetokenizer
from router.output.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class OutputStep:
    """What one batch of new tokens produced: text safe to send and the tokens accepted."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None


class OutputProcessor:
    """Accepts generated tokens in order and decides when the request ends.

    A token ends the request by the engine's own rule (core.request.stop_reason): an EOS token
    (unless ``ignore_eos``) or one of ``stop_token_ids`` at an output index >= ``min_tokens``, or
    the ``max_tokens``-th token; such a token is still part of the output tokens, but a stop
    token's text is not part of the output text (vLLM's rule, also with special tokens kept).
    A stop string ends it too; its text and everything after is dropped. Like vLLM, stop strings
    are looked for only once ``min_tokens`` tokens were generated (checked per batch of tokens:
    text of a batch that ends at or below ``min_tokens`` is sent unfiltered). Tokens arriving
    after the end are ignored.
    """

    def __init__(
        self,
        params: SamplingParams,
        stop: Sequence[str],
        eos_token_ids: frozenset[int],
        decode: Callable[[list[int]], str],
    ):
        self.params = params
        self.stop_token_ids = stop_token_ids(params, eos_token_ids)
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop_matcher = StopStringMatcher(stop)
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self._flushed = False

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def stopped_by_string(self) -> bool:
        return self.stop_matcher.stopped

    def add_tokens(self, token_ids: Iterable[int]) -> OutputStep:
        """Appends tokens up to the first that ends the request; returns the new text.

        Mutates ``token_ids`` and ``finish_reason``; once finished, held-back text is flushed.
        """
        accepted = []
        for token_id in token_ids:
            if self.finish_reason is not None:
                break
            accepted.append(token_id)
            self.token_ids.append(token_id)
            self.finish_reason = stop_reason(self.params, self.stop_token_ids, token_id, len(self.token_ids))
        stop_token = self.finish_reason is FinishReason.STOP  # ended by a stop token: its text is left out
        text = self.detokenizer.add(accepted[:-1] if stop_token else accepted)
        if len(self.token_ids) > self.params.min_tokens:
            text = self.stop_matcher.feed(text)
        if self.stop_matcher.stopped:
            self.finish_reason = FinishReason.STOP
        if self.finish_reason is not None:
            text += self._flush()
        return OutputStep(text, tuple(accepted), self.finish_reason)

    def finish(self, reason: FinishReason) -> str:
        """Ends the request for ``reason`` unless it already ended; returns the held-back text."""
        if self.finish_reason is None:
            self.finish_reason = reason
        return self._flush()

    def _flush(self) -> str:
        if self._flushed:
            return ""
        self._flushed = True
        text = self.stop_matcher.feed(self.detokenizer.flush())
        if self.stop_matcher.stopped:
            self.finish_reason = FinishReason.STOP
            return text
        return text + self.stop_matcher.flush()
