"""OpenAI API shapes: pydantic request bodies and the JSON of responses and stream chunks.

Request models accept and ignore unknown OpenAI fields; vLLM's extra fields (``top_k``,
``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``) are honoured. One
prompt per request; ``n`` choices of it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from collections.abc import Callable

from router.generation import Usage
from router.logprobs import LogprobsFormatter, TokenLogprob
from core.sampling_params import MAX_TOP_LOGPROBS
from router.validation import InvalidRequestError, RequestInput


class _OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_OpenAIModel):
    include_usage: bool = False


class _SamplingFields(_OpenAIModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # absent: 1.0, as OpenAI
    top_p: float | None = None
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None  # absent or null: 0
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # absent or null: 1 (disabled)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _input(self, max_tokens: int | None, logprobs: int | None, **prompt: Any) -> RequestInput:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return RequestInput(
            model=self.model,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            n=self.n,
            **prompt,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the k best tokens' logprobs per position (0: the sampled one's)

    def to_input(self) -> RequestInput:
        """Raises InvalidRequestError for several prompts in one request."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(f"a list of {len(prompt)} prompts is not supported yet; send one", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._input(self.max_tokens, self.logprobs, prompt=prompt)
        return self._input(self.max_tokens, self.logprobs, prompt_token_ids=tuple(prompt))


class ContentPart(_OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(_OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        """Raises InvalidRequestError for non-text content parts (images, audio)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.type != "text":
                raise InvalidRequestError(f"only text content parts are supported, got {part.type!r}", "messages")
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the k best tokens per position

    def to_input(self) -> RequestInput:
        """Raises InvalidRequestError for top_logprobs without logprobs, or out of [0, 20]."""
        messages = tuple({"role": m.role, "content": m.text()} for m in self.messages)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._input(max_tokens, logprobs, messages=messages)


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: str
    logprobs: tuple[TokenLogprob, ...] = ()


class ResponseShape:
    """How one endpoint's responses look; subclasses fill in the choice objects.

    With ``token_text`` (renders a token id) the choices carry logprobs; without it
    ``"logprobs": null``.
    """

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, request_id: str, model: str, created_s: int, token_text: Callable[[int], str] | None = None):
        self.request_id, self.model, self.created_s = request_id, model, created_s
        self.token_text = token_text
        self._formatters: dict[int, LogprobsFormatter] = {}  # choice index -> its formatter

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created_s, "model": self.model,
                "choices": choices, **extra}

    def response(self, choices: list[ChoiceResult], usage: Usage) -> dict:
        """The non-streaming body."""
        body = [
            self.final_choice(c.index, c.text, c.finish_reason, self._logprobs(c.index, c.logprobs)) for c in choices
        ]
        return self._envelope(self.object_name, body, usage=usage_json(usage))

    def chunk(
        self, index: int, text: str, finish_reason: str | None, first: bool, include_usage: bool,
        logprobs: tuple[TokenLogprob, ...] = (),
    ) -> dict:
        """One streamed chunk of choice ``index``; ``usage`` is null on every chunk but the last
        when asked for; ``first`` marks the choice's first chunk."""
        extra = {"usage": None} if include_usage else {}
        rendered = self._logprobs(index, logprobs) if logprobs else None  # a chunk without tokens: null
        choice = self.delta_choice(index, text, finish_reason, first, rendered)
        return self._envelope(self.chunk_object_name, [choice], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=usage_json(usage))

    def _logprobs(self, index: int, logprobs: tuple[TokenLogprob, ...]) -> dict | None:
        if self.token_text is None:
            return None
        formatter = self._formatters.setdefault(index, LogprobsFormatter(self.token_text))
        return self.format_logprobs(formatter, logprobs)

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        raise NotImplementedError

    def final_choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
        raise NotImplementedError

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None
    ) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        return formatter.completion(logprobs)

    def final_choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None
    ) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class ChatShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def format_logprobs(self, formatter: LogprobsFormatter, logprobs: tuple[TokenLogprob, ...]) -> dict:
        return formatter.chat(logprobs)

    def final_choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def delta_choice(
        self, index: int, text: str, finish_reason: str | None, first: bool, logprobs: dict | None
    ) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
