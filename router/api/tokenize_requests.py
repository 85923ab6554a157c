"""Request bodies of vLLM's ``/tokenize`` and ``/detokenize`` (pydantic), strict as the OpenAI
bodies (router.api.openai_requests): unknown fields refused by name, types not coerced.

``/tokenize`` takes a ``prompt`` (``add_special_tokens`` defaults to true) or chat ``messages``
(rendered by the chat template; ``add_special_tokens`` defaults to false, as vLLM's), and answers
``{"count", "max_model_len", "tokens", "token_strs"}``; ``/detokenize`` takes ``tokens`` and
answers ``{"prompt"}``.
"""

from __future__ import annotations

from typing import Any

from router.api.openai_requests import ChatMessage, _OpenAIModel
from router.api.validation import InvalidRequestError, RequestInput
from router.tokenizer import ChatOptions


class TokenizeRequest(_OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages
    add_generation_prompt: bool = True  # messages only
    continue_final_message: bool = False  # messages only
    chat_template_kwargs: dict[str, Any] | None = None  # messages only
    return_token_strs: bool = False  # also answer each token's vocabulary entry

    def to_input(self) -> RequestInput:
        """Raises InvalidRequestError unless exactly one of ``prompt`` and ``messages`` is set,
        or for ``add_generation_prompt`` with ``continue_final_message``."""
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("send exactly one of prompt and messages", "prompt")
        if self.prompt is not None:
            add_special_tokens = True if self.add_special_tokens is None else self.add_special_tokens
            return RequestInput(model=self.model, prompt=self.prompt, add_special_tokens=add_special_tokens)
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidRequestError("add_generation_prompt and continue_final_message cannot both be true: the "
                                      "first starts a new assistant message, the second continues the last one",
                                      "continue_final_message")
        chat = ChatOptions(self.add_generation_prompt, self.continue_final_message, bool(self.add_special_tokens),
                           self.chat_template_kwargs or {})
        messages = tuple({"role": m.role, "content": m.text(i)} for i, m in enumerate(self.messages))
        return RequestInput(model=self.model, messages=messages, chat=chat)


class DetokenizeRequest(_OpenAIModel):
    model: str | None = None
    tokens: list[int]
