"""Turns what a client sent into prompt token ids, SamplingParams and stop strings, or says why not.

Every check names the offending field (``param``), quotes the real numbers, and quotes strings as
JSON (``"bot"``), so a client can fix its request from the message alone. Text that cannot fit
the context is refused before it is tokenized (a token covers at most
``ModelTokenizer.max_token_chars`` characters), and :meth:`Validator.validate_async` tokenizes on
a worker thread, so one huge prompt never stalls the event loop that serves every other request.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from core.sampling_params import SamplingParams, SamplingParamsError
from router.api.tools import ToolRequest, ToolRequestError, check_tool_messages, template_message
from router.errors import ErrorKind, RouterError, as_json
from router.output.tool_calls import ToolCallFormat
from router.tokenizer import ChatOptions, ModelTokenizer


class InvalidRequestError(RouterError):
    """The request itself is wrong (HTTP 400 / INVALID_ARGUMENT; unknown model: 404 / NOT_FOUND)."""

    def __init__(self, message: str, param: str | None = None, kind: ErrorKind = ErrorKind.INVALID_REQUEST):
        super().__init__(message, kind, param)


@dataclass(frozen=True)
class RequestInput:
    """A request as a front-end received it, before any check.

    Exactly one of ``prompt`` (text), ``prompt_token_ids`` and ``messages`` (chat) is set. A
    message is ``{"role", "content"}`` (text), plus ``tool_calls`` (OpenAI's, arguments as JSON
    text) on an assistant message and ``tool_call_id`` on a tool message when sent. ``tools``:
    the tools a chat offers (router.api.tools), None when none.
    ``sampling``: the SamplingParams fields the client sent, by name (core.sampling_params
    declares them); an absent or None field takes SamplingParams' default, except ``max_tokens``,
    which takes the configured default clamped to what the context leaves.
    ``best_of``: candidates generated per prompt, the ``n`` of highest cumulative logprob
    returned (None: ``n``). ``add_special_tokens``: a text prompt gets the tokenizer's special
    tokens (BOS); ``chat``: how ``messages`` are rendered. ``skip_special_tokens``: special
    tokens are left out of the output text.
    """

    model: str | None = None
    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    n: int = 1
    # The field that asked for ``sampling["structured_outputs"]`` (``response_format.json_schema
    # .schema``, ``guided_regex``, ...): a worker's refusal of the spec names it.
    structured_param: str | None = None
    tools: ToolRequest | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    chat: ChatOptions = field(default_factory=ChatOptions)
    skip_special_tokens: bool = True

    @property
    def max_tokens(self) -> int | None:
        return self.sampling.get("max_tokens")

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """The request's SamplingParams, with ``max_tokens`` as the validator resolved it.

        Raises:
            SamplingParamsError: the first field out of its range.
        """
        return SamplingParams.from_optional(**{**self.sampling, "max_tokens": max_tokens})


MAX_N = 64  # choices per request: each is a sub-request on the workers
MAX_CHOICES = 256  # sub-requests of one request: prompts x candidates (best_of or n)
MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
# Chat roles the template renders; "developer" is OpenAI's newer name for "system" and is sent as it.
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")


@dataclass(frozen=True)
class ValidatedRequest:
    """What generation needs: the prompt as tokens, checked sampling parameters, stop strings,
    how many choices to return (``n``) out of how many candidates (``best_of``: None is ``n``;
    more than ``n`` forces logprobs on, to rank them), how the output is detokenized, and how it
    holds tool calls (``tool_format`` None: it holds none)."""

    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop: tuple[str, ...]
    n: int = 1
    structured_param: str | None = None  # see RequestInput
    tool_format: ToolCallFormat | None = None
    best_of: int | None = None
    skip_special_tokens: bool = True

    @property
    def num_candidates(self) -> int:
        return self.best_of or self.n


def check_n(n: int) -> None:
    """Raises InvalidRequestError (``param`` n) unless 1 <= ``n`` <= MAX_N."""
    if not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}], got {n}", "n")


class Validator:
    """Checks requests against the served model's name, vocabulary and context limit."""

    def __init__(self, tokenizer: ModelTokenizer, served_model_name: str, max_model_len: int, default_max_tokens: int,
                 tool_call_parser: str = "hermes"):
        """``default_max_tokens``: a completion's ``max_tokens`` when absent (OpenAI's legacy
        completions use 16); a chat's absent ``max_tokens`` is the rest of the context, as vLLM
        and OpenAI chat do. ``tool_call_parser``: how calls are read under ``tool_choice:
        "auto"`` (router.output.tool_calls)."""
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self.default_max_tokens = default_max_tokens
        self.tool_call_parser = tool_call_parser

    async def validate_async(self, request: RequestInput) -> ValidatedRequest:
        """:meth:`validate` on a worker thread: tokenizing a long prompt or rendering a chat
        template takes up to a second, during which the event loop keeps serving.

        Raises:
            InvalidRequestError: as :meth:`validate`.
        """
        return await asyncio.to_thread(self.validate, request)

    def validate(self, request: RequestInput) -> ValidatedRequest:
        """Tokenizes and checks ``request``.

        Raises:
            InvalidRequestError: the first problem found, with its ``param``.
        """
        self.check_model(request.model)
        self._check_request(request)
        self._check_text(request)
        prompt_token_ids = self._tokenize(request)
        chat = request.messages is not None
        max_tokens = self._max_tokens(len(prompt_token_ids), request.max_tokens, "messages" if chat else "prompt", chat)
        try:
            params = request.to_sampling_params(max_tokens)
        except SamplingParamsError as err:
            raise InvalidRequestError(str(err), err.param) from None
        self._check_token_ids(params.stop_token_ids, "stop_token_ids")
        if (request.best_of or request.n) > request.n and params.logprobs is None:
            params = dataclasses.replace(params, logprobs=0)  # candidates are ranked by cumulative logprob
        tool_format = request.tools.output_format(self.tool_call_parser) if request.tools else None
        return ValidatedRequest(prompt_token_ids, params, tuple(request.stop), request.n, request.structured_param,
                                tool_format, request.best_of, request.skip_special_tokens)

    def check_model(self, model: str | None) -> None:
        """Raises InvalidRequestError (404, MODEL_NOT_FOUND) unless ``model`` is absent (None:
        the served model, as vLLM takes it) or served; an empty name is an unknown one."""
        if model is not None and model != self.served_model_name:
            raise InvalidRequestError(
                f"model {as_json(model)} does not exist; this cluster serves {as_json(self.served_model_name)}",
                "model",
                ErrorKind.MODEL_NOT_FOUND,
            )

    def tokenize(self, request: RequestInput) -> list[int]:
        """The prompt's token ids for ``/tokenize``: the model, chat roles and Unicode checked,
        the context limit not (a client may count the tokens of a text too long to serve).

        Raises:
            InvalidRequestError: with its ``param``.
        """
        self.check_model(request.model)
        self._check_text(request, check_length=False)
        return self._encode(request)

    def check_token_ids(self, token_ids, param: str) -> None:
        """Raises InvalidRequestError naming ``param`` for a token id outside the vocabulary."""
        self._check_token_ids(token_ids, param)

    def _check_request(self, request: RequestInput) -> None:
        """What the API allows beyond SamplingParams' own ranges: OpenAI's temperature range,
        ``n`` and the stop strings."""
        temperature = request.sampling.get("temperature")
        if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN, infinities
            raise InvalidRequestError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}", "temperature")
        check_n(request.n)
        if any(not s for s in request.stop):
            raise InvalidRequestError("stop strings must not be empty", "stop")
        if request.best_of is not None and not request.n <= request.best_of <= MAX_N:
            raise InvalidRequestError(f"best_of must be in [n, {MAX_N}] (n is {request.n}), got {request.best_of}",
                                      "best_of")

    def _check_text(self, request: RequestInput, check_length: bool = True) -> None:
        """Chat roles, text that is valid Unicode (JSON can carry a lone UTF-16 surrogate, which
        no tokenizer takes), and (``check_length``) a prompt that may fit the context, checked
        without tokenizing."""
        texts = [("prompt", request.prompt or "")]
        if request.messages is not None:
            if not request.messages:
                raise InvalidRequestError("messages must not be empty", "messages")
            if check_length and len(request.messages) > self.max_model_len:
                # every message renders to one token or more (its role's markers): refused before
                # the chat template renders them all (seconds for 10^5 messages, holding the GIL)
                raise InvalidRequestError(f"messages has {len(request.messages)} messages, more than the context's "
                                          f"{self.max_model_len} tokens (each message is one token or more)",
                                          "messages")
            texts = [(f"messages.{i}.content", m["content"]) for i, m in enumerate(request.messages)]
            for i, message in enumerate(request.messages):
                _check_role(message["role"], f"messages.{i}.role")
            try:
                check_tool_messages(request.messages)
            except ToolRequestError as err:
                raise InvalidRequestError(err.message, err.param) from None
        for param, text in [*texts, *((f"stop.{i}", s) for i, s in enumerate(request.stop))]:
            _check_unicode(text, param)
        if not check_length:
            return
        num_chars = sum(len(text) for _, text in texts)
        min_tokens = self.tokenizer.min_num_tokens(num_chars)
        if min_tokens > self.max_model_len:
            param = "messages" if request.messages is not None else "prompt"
            raise InvalidRequestError(
                f"{param} has {num_chars} characters, so at least {min_tokens} tokens (a token covers at most "
                f"{self.tokenizer.max_token_chars} characters), but the context is {self.max_model_len}",
                param,
            )

    def _tokenize(self, request: RequestInput) -> list[int]:
        if request.prompt_token_ids is not None:
            ids = list(request.prompt_token_ids)
            if len(ids) > self.max_model_len:  # before scanning every id of a huge list
                raise _too_long(len(ids), self.max_model_len, "prompt")
            self._check_token_ids(ids, "prompt")
        else:
            ids = self._encode(request)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        return ids

    def _encode(self, request: RequestInput) -> list[int]:
        """The token ids of a text prompt or a chat (as sent, for token ids)."""
        if request.messages is not None:
            messages = [template_message(m) for m in request.messages]
            tools = request.tools.prompt_tools if request.tools else None
            try:
                return self.tokenizer.encode_chat(messages, tools, request.chat)
            except ValueError as err:
                param = "chat_template_kwargs" if str(err).startswith("chat_template_kwargs") else "messages"
                raise InvalidRequestError(str(err), param) from err
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return self.tokenizer.encode(request.prompt, request.add_special_tokens) if request.prompt else []

    def _check_token_ids(self, token_ids, param: str) -> None:
        vocab_size = self.tokenizer.vocab_size
        for token_id in token_ids:
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"{param} has token id {token_id}, outside the vocabulary [0, {vocab_size})", param
                )

    def _max_tokens(self, num_prompt_tokens: int, max_tokens: int | None, param: str, chat: bool) -> int:
        """The request's max_tokens, checked against the context left; when absent, the rest of
        the context (chat) or the default clamped to it (completions)."""
        limit = self.max_model_len
        if num_prompt_tokens > limit:
            raise _too_long(num_prompt_tokens, limit, param)
        if max_tokens is None:
            if num_prompt_tokens == limit:
                raise InvalidRequestError(
                    f"prompt has {num_prompt_tokens} tokens, which fills the context of {limit}; "
                    "no room is left to generate",
                    param,
                )
            return limit - num_prompt_tokens if chat else min(self.default_max_tokens, limit - num_prompt_tokens)
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
                f"{num_prompt_tokens + max_tokens} tokens exceed the context of {limit}",
                "max_tokens",
            )
        return max_tokens


def name_structured_param(err: RouterError, request: ValidatedRequest) -> RouterError:
    """A worker's refusal of a structured request (a grammar the library cannot compile reaches
    the router as INVALID_ARGUMENT) names the field that asked for the structured output.
    Mutates and returns ``err``."""
    if err.kind is ErrorKind.INVALID_REQUEST and err.param is None and request.structured_param is not None:
        err.param = request.structured_param
    return err


def _too_long(num_prompt_tokens: int, max_model_len: int, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"prompt has {num_prompt_tokens} tokens but the context is {max_model_len}", param)


def _check_role(role: str, param: str) -> None:
    if role == "function":  # OpenAI's deprecated function calling
        raise InvalidRequestError(f'{param} "function" is not supported: send a function\'s result as a "tool" '
                                  "message", param)
    if role not in CHAT_ROLES:
        allowed = ", ".join(as_json(r) for r in CHAT_ROLES)
        raise InvalidRequestError(f"{param} must be one of {allowed}, got {as_json(role)}", param)


def _check_unicode(text: str, param: str) -> None:
    """Raises InvalidRequestError naming ``param`` and the character position when ``text``
    holds a lone surrogate (it cannot be encoded as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code_point = ord(text[err.start])
        raise InvalidRequestError(
            f"{param} is not valid Unicode: lone surrogate U+{code_point:04X} at character {err.start}", param
        ) from None
