"""Token log-probabilities in the router, and their two OpenAI JSON shapes.

Completions (legacy)::

    {"tokens": ["Hello", ","], "token_logprobs": [-0.1, -2.3],
     "top_logprobs": [{"Hello": -0.1, "Hi": -2.5}, ...], "text_offset": [0, 5]}

Chat::

    {"content": [{"token": "Hello", "logprob": -0.1, "bytes": [72, ...],
                  "top_logprobs": [{"token": "Hello", "logprob": -0.1, "bytes": [...]}, ...]}, ...]}

A token's ``bytes`` are its own raw bytes (router.tokenizer ``token_bytes``), so the bytes of a
text's tokens join into its UTF-8 even where a token holds part of a character (its ``token``
text is then U+FFFD). A masked token's logprob is -inf, which JSON cannot carry: it is clamped to -9999.0 (as vLLM).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the request's ``top_logprobs`` best alternatives; a
    prompt's first token (echoed) has none: ``logprob`` None."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


def _clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(float(logprob), MIN_LOGPROB)


class LogprobsFormatter:
    """Renders one choice's logprobs, chunk by chunk; keeps the completion text offset.

    ``token_text`` renders one token id as text (special tokens included); ``token_bytes`` gives
    its raw bytes (None: the UTF-8 of its text, right only for tokens that hold whole characters).
    """

    def __init__(self, token_text: Callable[[int], str], token_bytes: Callable[[int], bytes] | None = None):
        self.token_text = token_text
        self.token_bytes = token_bytes or (lambda token_id: token_text(token_id).encode("utf-8"))
        self.text_offset = 0  # characters of token text rendered so far (completions)

    def completion(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """The legacy ``logprobs`` object; ``top_logprobs`` includes the sampled token, as vLLM;
        a token without a logprob (an echoed prompt's first) has null for both, as vLLM.

        Mutates ``text_offset``.
        """
        tokens, offsets, tops = [], [], []
        for lp in logprobs:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            offsets.append(self.text_offset)
            self.text_offset += len(text)
            if lp.logprob is None:
                tops.append(None)
                continue
            top = {self.token_text(t): _clamp(v) for t, v in lp.top_logprobs}
            top.setdefault(text, _clamp(lp.logprob))
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [_clamp(lp.logprob) for lp in logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict:
        """The chat ``logprobs`` object: ``{"content": [...]}``."""
        return {"content": [
            {**self._entry(lp.token_id, lp.logprob), "top_logprobs": [self._entry(t, v) for t, v in lp.top_logprobs]}
            for lp in logprobs
        ]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        return {"token": self.token_text(token_id), "logprob": _clamp(logprob), "bytes": list(self.token_bytes(token_id))}
