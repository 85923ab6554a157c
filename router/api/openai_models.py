"""OpenAI API response shapes: the JSON of responses and stream chunks (request bodies are in
router.api.openai_requests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.generation import Usage
from router.output.logprobs import LogprobsFormatter, TokenLogprob
from router.output.tool_calls import ToolCall, ToolCallDelta


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-streamed response; ``text`` is its content, without the
    text its ``tool_calls`` were read from."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


class ResponseShape:
    """How one endpoint's responses look; subclasses fill in the choice objects.

    With ``token_text`` (renders a token id) the choices carry logprobs; without it
    ``"logprobs": null``. ``token_bytes``: a token's raw bytes (router.output.logprobs).
    """

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, request_id: str, model: str, created_s: int, token_text: Callable[[int], str] | None = None,
                 token_bytes: Callable[[int], bytes] | None = None):
        self.request_id, self.model, self.created_s = request_id, model, created_s
        self.token_text, self.token_bytes = token_text, token_bytes
        self._formatters: dict[int, LogprobsFormatter] = {}  # choice index -> its formatter

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created_s, "model": self.model,
                "choices": choices, **extra}

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict:
        """The non-streaming body."""
        body = [
            self.final_choice(c.index, c.text, c.finish_reason, self._logprobs(c.index, c.logprobs), c.tool_calls)
            for c in choices
        ]
        return self._envelope(self.object_name, body, usage=usage_json(usage))

    def chunk(
        self, index: int, text: str, finish_reason: str | None, first: bool, include_usage: bool,
        logprobs: tuple[TokenLogprob, ...] = (), tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> dict:
        """One streamed chunk of choice ``index``; ``usage`` is null on every chunk but the last
        when asked for; ``first`` marks the choice's first chunk."""
        extra = {"usage": None} if include_usage else {}
        rendered = self._logprobs(index, logprobs) if logprobs else None  # a chunk without tokens: null
        choice = self.delta_choice(index, text, finish_reason, first, rendered, tool_calls)
        return self._envelope(self.chunk_object_name, [choice], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=usage_json(usage))

    def _logprobs(self, index: int, logprobs: tuple[TokenLogprob, ...]) -> dict | None:
        if self.token_text is None:
            return None
        formatter = self._formatters.setdefault(index, LogprobsFormatter(self.token_text, self.token_bytes))
        return self.format_logprobs(formatter, logprobs)

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        raise NotImplementedError

    def final_choice(
        self, index: int, text: str, finish_reason: str, logprobs: dict | None, tool_calls: tuple[ToolCall, ...] = ()
    ) -> dict:
        raise NotImplementedError

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None,
        tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        return formatter.completion(logprobs)

    def final_choice(
        self, index: int, text: str, finish_reason: str, logprobs: dict | None, tool_calls: tuple[ToolCall, ...] = ()
    ) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None,
        tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class ChatShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        return formatter.chat(logprobs)

    def final_choice(
        self, index: int, text: str, finish_reason: str, logprobs: dict | None, tool_calls: tuple[ToolCall, ...] = ()
    ) -> dict:
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:  # OpenAI's content is null beside calls when the model wrote nothing else
            message.update(content=text or None, tool_calls=[call.to_openai() for call in tool_calls])
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None,
        tool_calls: tuple[ToolCallDelta, ...] = (),
    ) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = [call.to_openai() for call in tool_calls]
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
