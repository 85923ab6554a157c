"""OpenAI API shapes: pydantic request bodies and the JSON of responses and stream chunks.

Request models accept and ignore unknown OpenAI fields; vLLM's extra fields (``top_k``,
``ignore_eos``, ``stop_token_ids``) are honoured. Only ``n == 1`` and a single prompt are
supported.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from router.generation import Finished, Usage
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
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _input(self, max_tokens: int | None, **prompt: Any) -> RequestInput:
        """Raises InvalidRequestError for ``n`` other than 1."""
        if self.n > 1:
            raise InvalidRequestError("n > 1 is not supported yet", "n")
        if self.n < 1:
            raise InvalidRequestError(f"n must be >= 1, got {self.n}", "n")
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
            **prompt,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]

    def to_input(self) -> RequestInput:
        """Raises InvalidRequestError for several prompts in one request."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError(f"a list of {len(prompt)} prompts is not supported yet; send one", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self._input(self.max_tokens, prompt=prompt)
        return self._input(self.max_tokens, prompt_token_ids=tuple(prompt))


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

    def to_input(self) -> RequestInput:
        messages = tuple({"role": m.role, "content": m.text()} for m in self.messages)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._input(max_tokens, messages=messages)


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class ResponseShape:
    """How one endpoint's responses look; subclasses fill in the choice objects."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, request_id: str, model: str, created_s: int):
        self.request_id, self.model, self.created_s = request_id, model, created_s

    def _envelope(self, object_name: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.request_id, "object": object_name, "created": self.created_s, "model": self.model,
                "choices": choices, **extra}

    def response(self, text: str, finished: Finished) -> dict:
        """The non-streaming body."""
        choice = self.final_choice(text, finished.finish_reason.value)
        return self._envelope(self.object_name, [choice], usage=usage_json(finished.usage))

    def chunk(self, text: str, finish_reason: str | None, first: bool, include_usage: bool) -> dict:
        """One streamed chunk; ``usage`` is null on every chunk but the last when asked for."""
        extra = {"usage": None} if include_usage else {}
        return self._envelope(self.chunk_object_name, [self.delta_choice(text, finish_reason, first)], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self._envelope(self.chunk_object_name, [], usage=usage_json(usage))

    def final_choice(self, text: str, finish_reason: str) -> dict:
        raise NotImplementedError

    def delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        raise NotImplementedError


class CompletionShape(ResponseShape):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def final_choice(self, text: str, finish_reason: str) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatShape(ResponseShape):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def final_choice(self, text: str, finish_reason: str) -> dict:
        message = {"role": "assistant", "content": text}
        return {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None, first: bool) -> dict:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
