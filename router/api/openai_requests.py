"""OpenAI request bodies (pydantic) and how their validation errors read.

Bodies are strict about names: an unknown field is refused ("unrecognized request argument"),
and an OpenAI field this server does not implement (``suffix``, ``logit_bias``, ``functions``, ...)
is refused unless it carries its default, so a misspelled or ignored parameter never changes the
output silently. A structured output (``response_format``, vLLM's ``guided_*`` and
``structured_outputs``) is router.api.structured_outputs'; ``tools``, ``tool_choice`` and the
messages' tool calls and results are router.api.tools'. The sampling fields are SamplingParams' own
(core.sampling_params declares each once, with its default): OpenAI's and vLLM's extras
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``min_tokens``, ``repetition_penalty``) alike,
absent or null meaning the default; ``user``, ``metadata`` and the like are accepted and
ignored. Types are strict, as OpenAI's API is: a number sent as a string
(``"max_tokens": "5"``), a boolean sent as 0/1 or a string (``"stream": 1``), a number sent as
a boolean, or a float for an integer (``2.5``, also ``2.0``) is refused with the field's name;
an integer is a valid float. A completion's ``prompt`` may be a list of prompts (strings or
token-id lists): one sub-request per prompt and candidate (router.api.choices). vLLM's
``skip_special_tokens``, ``add_special_tokens`` and ``chat_template_kwargs`` are accepted.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr, create_model, model_validator

from core.sampling_params import MAX_TOP_LOGPROBS, SAMPLING_FIELDS, SamplingParams
from core.structured_output import StructuredOutputSpec
from router.errors import as_json
from router.api.structured_outputs import StructuredOutputFields
from router.api.tools import ToolRequest, ToolRequestError, tool_request
from router.api.validation import MAX_CHOICES, InvalidRequestError, RequestInput, check_n
from router.tokenizer import ChatOptions


def _none(value: Any) -> bool:
    return value is None


def _empty(value: Any) -> bool:
    return value is None or value == {} or value == [] or value == "" or value is False


def _no_tool_choice(value: Any) -> bool:
    return value is None or value in ("none", "auto")  # "auto" without tools chooses none


# Unsupported OpenAI fields: name -> (is the value harmless, what is accepted).
COMMON_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logit_bias": (_empty, "{}"),
}
COMPLETION_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "suffix": (_empty, 'null or ""'),
}
CHAT_UNSUPPORTED = {
    **COMMON_UNSUPPORTED,
    "functions": (_empty, "[]"),  # OpenAI's deprecated function calling: tools replace it
    "function_call": (_no_tool_choice, '"none"'),
    "modalities": (lambda v: v is None or v == ["text"], '["text"]'),
    "audio": (_none, "null"),
    "prediction": (_none, "null"),
    "reasoning_effort": (_none, "null"),
    "verbosity": (_none, "null"),
    "web_search_options": (_none, "null"),
    "store": (_empty, "false"),
    "service_tier": (lambda v: v in (None, "auto", "default"), '"auto" or "default"'),
}
# OpenAI's rule: only an assistant's content may be null or absent (a message of tool calls).
CONTENT_REQUIRED_ROLES = ("system", "developer", "user", "tool")
MESSAGE_UNSUPPORTED = {
    "function_call": (_none, "null"),
    "audio": (_none, "null"),
    "refusal": (_none, "null"),
}


def _short(value: Any) -> str:
    """``value`` as the JSON the client sent, cut to 60 characters."""
    text = as_json(value)
    return text if len(text) <= 60 else text[:57] + "..."


class _OpenAIModel(BaseModel):
    """A body that refuses unknown fields. The OpenAI fields it does not implement are listed
    once, in ``unsupported_fields``: they are taken out of the body before pydantic sees it
    (so they need no field declaration) and checked by :meth:`_refuse_unsupported`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    unsupported_fields: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}
    _unsupported_values: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _set_aside_unsupported(cls, data: Any, handler):
        if not isinstance(data, dict) or not cls.unsupported_fields.keys() & data.keys():
            return handler(data)
        unsupported = {k: v for k, v in data.items() if k in cls.unsupported_fields}
        model = handler({k: v for k, v in data.items() if k not in cls.unsupported_fields})
        model._unsupported_values = unsupported
        return model

    def _refuse_unsupported(self, prefix: str = "") -> None:
        """Raises InvalidRequestError for the first unsupported field set to a non-default value."""
        for name, (harmless, accepted) in self.unsupported_fields.items():
            value = self._unsupported_values.get(name)
            if not harmless(value):
                raise InvalidRequestError(
                    f"{prefix}{name} is not supported (only {accepted} is accepted), got {_short(value)}",
                    f"{prefix}{name}",
                )


class StreamOptions(_OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: no padding is sent


def _body_type(hint: Any) -> Any:
    """A SamplingParams field's type in a JSON body: optional (null: the default), a tuple sent
    as a list."""
    if typing.get_origin(hint) is tuple:
        hint = list[typing.get_args(hint)[0]]
    return hint | None


# SamplingParams fields a body spells its own way (router.api.structured_outputs builds the spec
# from response_format, guided_* and structured_outputs, declared by StructuredOutputFields).
_OWN_BODY_FIELDS = ("structured_outputs",)
# Every other SamplingParams field is a body field of the same name and type, absent or null
# meaning its default (so a field added to SamplingParams is accepted here as it is).
_SamplingParamsFields = create_model(
    "_SamplingParamsFields",
    __base__=_OpenAIModel,
    **{name: (_body_type(hint), None) for name, hint in typing.get_type_hints(SamplingParams).items()
       if name in SAMPLING_FIELDS and name not in _OWN_BODY_FIELDS},
)


class _SamplingFields(_SamplingParamsFields, StructuredOutputFields):
    """The fields both bodies share: SamplingParams' (inherited, see above), the structured
    output's (router.api.structured_outputs) and these."""

    model: str | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True  # vLLM's: special tokens left out of the text
    # Accepted and ignored: end-user and caching metadata.
    user: str | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _input(self, prompt: dict[str, Any], **sampling: Any) -> RequestInput:
        """The request for the validator: the prompt, and every SamplingParams field as sent,
        ``sampling`` replacing those a body spells its own way (chat's ``max_completion_tokens``
        and ``logprobs`` / ``top_logprobs``); the structured output's spec under ``structured_outputs``.

        Raises:
            InvalidRequestError: an unsupported field, ``stream_options`` without ``stream``, or
                a bad structured output.
        """
        self._refuse_unsupported()
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not supported: use echo with logprobs on /v1/completions",
                                      "prompt_logprobs")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        spec, structured_param = self.structured_output_spec()
        fields = {name: getattr(self, name) for name in SAMPLING_FIELDS if name not in _OWN_BODY_FIELDS} | sampling
        fields["structured_outputs"] = spec
        return RequestInput(model=self.model, sampling=fields, stop=tuple(stop), n=self.n,
                            structured_param=structured_param, skip_special_tokens=self.skip_special_tokens, **prompt)


class CompletionRequest(_SamplingFields):
    unsupported_fields = COMPLETION_UNSUPPORTED

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False  # the prompt's text before each choice's
    best_of: int | None = None  # candidates per prompt; the n of highest cumulative logprob are returned
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts: a string or a token-id list, or a list of either."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        return [prompt]

    def to_inputs(self) -> list[RequestInput]:
        """One request per prompt.

        Raises:
            InvalidRequestError: more than MAX_CHOICES sub-requests, ``best_of`` with
                ``stream``, or an unsupported field.
        """
        prompts = self.prompts  # [] is one prompt of no tokens: the validator says it is empty
        check_n(self.n)  # before the choice count: n alone may be out of range
        num_candidates = max(self.n, self.best_of or 0)
        if len(prompts) * num_candidates > MAX_CHOICES:
            raise InvalidRequestError(
                f"{len(prompts)} prompts x {num_candidates} choices is {len(prompts) * num_candidates} completions; "
                f"at most {MAX_CHOICES} in one request", "prompt")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise InvalidRequestError(f"best_of ({self.best_of}) > n ({self.n}) cannot be streamed: the best "
                                      "choices are known only once every candidate finished", "best_of")
        # echo with logprobs: the prompt tokens' logprobs too (the workers compute the prompt whole).
        prompt_logprobs = self.logprobs if self.echo else None
        inputs = []
        for prompt in prompts:
            fields = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": tuple(prompt)}
            request = self._input(fields, prompt_logprobs=prompt_logprobs)
            inputs.append(dataclasses.replace(request, best_of=self.best_of, add_special_tokens=self.add_special_tokens))
        return inputs


class ContentPart(BaseModel):
    """A content part; other part types (images, audio) carry fields of their own, so only
    ``type`` is checked first."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionDefinition(_OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: no parameters
    strict: bool | None = None  # accepted: a forced call's grammar is always strict (router.api.tools)


class ToolDefinition(_OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_OpenAIModel):
    name: str


class NamedToolChoice(_OpenAIModel):
    type: Literal["function"]
    function: FunctionName


class ToolCallFunction(_OpenAIModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_OpenAIModel):
    unsupported_fields = MESSAGE_UNSUPPORTED

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None  # accepted, ignored (the chat template has no place for it)
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls (router.api.tools)
    tool_call_id: str | None = None  # a tool message: the call it answers

    def to_input(self, index: int) -> dict[str, Any]:
        """The message as the validator takes it: role and text content, and its tool fields
        when set. Raises InvalidRequestError as :meth:`text`."""
        message: dict[str, Any] = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self, index: int) -> str:
        """Raises InvalidRequestError for null or absent content outside an assistant message,
        non-text content parts (images, audio), unknown fields of a text part, or an unsupported
        field of message ``index``."""
        self._refuse_unsupported(f"messages.{index}.")
        if self.content is None and self.role in CONTENT_REQUIRED_ROLES:
            got = ", got null" if "content" in self.model_fields_set else ""
            raise InvalidRequestError(f"messages.{index}.content is required on a {as_json(self.role)} message "
                                      f"(text or a list of content parts){got}", f"messages.{index}.content")
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for j, part in enumerate(self.content):
            param = f"messages.{index}.content.{j}"
            if part.type != "text":
                raise InvalidRequestError(f"only text content parts are supported, got {as_json(part.type)}", param)
            if part.model_extra:
                names = ", ".join(sorted(part.model_extra))
                raise InvalidRequestError(f"unrecognized request argument: {param}.{names}", param)
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    unsupported_fields = CHAT_UNSUPPORTED

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None  # with logprobs: the k best tokens per position
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None  # "none", "auto", "required" or a function
    parallel_tool_calls: bool | None = None  # tool_choice "required" may call several tools
    chat_template_kwargs: dict[str, Any] | None = None  # extra chat template variables (vLLM's)
    _tool_request: ToolRequest | None = PrivateAttr(default=None)  # the tools, checked by to_input

    def to_inputs(self) -> list[RequestInput]:
        """The one request of a chat (see :meth:`to_input`)."""
        return [self.to_input()]

    def to_input(self) -> RequestInput:
        """Raises InvalidRequestError for top_logprobs without logprobs, or out of [0, 20], for
        unsupported fields or content parts, and for tools or a tool_choice router.api.tools
        refuses."""
        messages = tuple(m.to_input(i) for i, m in enumerate(self.messages))
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise InvalidRequestError(f"max_tokens ({self.max_tokens}) and max_completion_tokens "
                                      f"({self.max_completion_tokens}) disagree; send one of them",
                                      "max_completion_tokens")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}", "top_logprobs"
            )
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        self._tool_request = self._tools()
        chat = ChatOptions(template_kwargs=self.chat_template_kwargs or {})
        return self._input({"messages": messages, "tools": self._tool_request, "chat": chat}, max_tokens=max_tokens,
                           logprobs=logprobs)

    def structured_output_spec(self) -> tuple[StructuredOutputSpec | None, str | None]:
        """The grammar of a forced tool call (``tool_choice`` ``"required"`` or a named function,
        router.api.tools), else the structured output the body asks for; not both.

        Raises:
            InvalidRequestError: both, or as StructuredOutputFields.structured_output_spec.
        """
        spec, param = super().structured_output_spec()
        tools = self._tool_request
        grammar = tools.structured_output() if tools else None
        if grammar is None:
            return spec, param
        if spec is not None:
            raise InvalidRequestError(f"{param} cannot be combined with tool_choice {as_json(self._tool_choice())}: "
                                      "the calls follow the functions' parameters", param)
        return grammar, tools.grammar_param

    def _tool_choice(self) -> str | dict | None:
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice

    def _tools(self) -> ToolRequest | None:
        try:
            return tool_request([t.model_dump(exclude_none=True) for t in self.tools or ()], self._tool_choice(),
                                self.parallel_tool_calls)
        except ToolRequestError as err:
            raise InvalidRequestError(err.message, err.param) from None


def body_error(errors: list[dict], json_body: bool) -> InvalidRequestError:
    """The pydantic/JSON errors of a request body as one OpenAI 400, naming the field.

    Unknown fields are listed together ("unrecognized request argument: temprature"); a value
    of the wrong type is quoted as JSON (``max_tokens: Input should be a valid integer, got "5"``);
    one that matches no member of a union (``"prompt": 42``) names the field itself, not the
    member (``prompt``, not ``prompt.str``); a body that is not a JSON object says so, with the
    Content-Type hint when the client sent another (``curl -d`` sends form data).
    """
    if not errors:
        return InvalidRequestError("invalid request body", None)
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return InvalidRequestError(f"malformed JSON body: {detail}", None)
    unknown = [_path(e["loc"]) for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        plural = "s" if len(unknown) > 1 else ""
        return InvalidRequestError(f"unrecognized request argument{plural}: {', '.join(unknown)}", unknown[0])
    if first.get("type") == "string_unicode":  # pydantic refuses a field name with a lone surrogate
        where = _path(first["loc"])
        return InvalidRequestError(f"a field name {'in ' + where + ' ' if where else ''}is not valid Unicode "
                                   "(it holds a lone UTF-16 surrogate)", where or None)
    if not _path(first["loc"]):
        hint = "" if json_body else " (send it with Content-Type: application/json)"
        return InvalidRequestError(f"the request body must be a JSON object{hint}", None)
    loc = tuple(first["loc"])
    tag_at = next((i for i, part in enumerate(loc) if _is_union_member(part)), None)
    if tag_at is None:
        got = "" if first.get("type") == "missing" else f", got {_short(first.get('input'))}"
        return InvalidRequestError(f"{_path(loc)}: {first['msg']}{got}", _path(loc))
    prefix, param = loc[:tag_at], _path(loc[:tag_at])  # "prompt", not "prompt.str"
    members = [tuple(e["loc"])[tag_at] for e in errors if tuple(e["loc"])[:tag_at] == prefix
               and len(e["loc"]) > tag_at and _is_union_member(e["loc"][tag_at])]
    accepted = ", ".join(dict.fromkeys(members))
    return InvalidRequestError(f"{param}: expected one of {accepted}, got {_short(first.get('input'))}", param)


def _is_union_member(part: Any) -> bool:
    """pydantic tags each member of a union in the error location with its type (``str``,
    ``list[int]``); field names are snake_case and list indices ints."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper())


def _path(loc) -> str:
    """A pydantic location as a dotted param, without the leading ``body``; a field name that
    is not valid Unicode is escaped (the error body must encode as UTF-8)."""
    parts = [str(part) for part in loc if part != "body"]
    return ".".join(parts).encode("utf-8", "backslashreplace").decode("utf-8")
