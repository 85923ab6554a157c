"""OpenAI request bodies: unknown fields refused by name, vLLM extras honoured, unsupported ones refused."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from core.sampling_params import SAMPLING_FIELDS, SamplingParams
from router.api.openai_requests import ChatCompletionRequest, CompletionRequest, body_error
from router.api.validation import InvalidRequestError


def test_completion_fields_and_vllm_extras() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "stop": "\n", "top_k": 5, "ignore_eos": True, "stop_token_ids": [7],
         "logit_bias": {}, "user": "u", "stream": True, "stream_options": {"include_usage": True}}
    )
    request = body.to_inputs()[0]
    params = request.to_sampling_params(16)
    assert (request.prompt, request.stop, params.top_k, params.ignore_eos, params.stop_token_ids) == (
        "hi", ("\n",), 5, True, (7,))
    assert (params.temperature, params.top_p, request.max_tokens) == (1.0, 1.0, None)
    assert body.include_usage


# A value other than the default for every SamplingParams field, as a JSON body sends it.
SENT = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.05, "seed": 11, "max_tokens": 9, "min_tokens": 2,
        "stop_token_ids": [5, 6], "ignore_eos": True, "logprobs": 3, "presence_penalty": 0.25,
        "frequency_penalty": -0.5, "repetition_penalty": 1.5}


def test_every_sampling_field_is_a_body_field_that_reaches_the_params() -> None:
    # A new field needs a value here; a structured output has its own fields (test_structured_outputs.py),
    # prompt_logprobs is set by echo with logprobs, refused as a field.
    assert set(SENT) | {"structured_outputs", "prompt_logprobs"} == set(SAMPLING_FIELDS)
    request = CompletionRequest.model_validate({"prompt": "x", **SENT}).to_inputs()[0]
    assert request.to_sampling_params(9) == SamplingParams(**{**SENT, "stop_token_ids": (5, 6)})
    nulls = CompletionRequest.model_validate({"prompt": "x", **dict.fromkeys(SENT)}).to_inputs()[0]
    assert nulls.to_sampling_params(16) == SamplingParams() and nulls.max_tokens is None
    chat = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], **SENT, "logprobs": True, "top_logprobs": 3}).to_inputs()[0]
    assert chat.to_sampling_params(9) == request.to_sampling_params(9)


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts(prompt) -> None:
    assert CompletionRequest(prompt=prompt).to_inputs()[0].prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"prompt": ["a"] * 65, "n": 4}, "65 prompts x 4 choices is 260 completions; at most 256 in one request",
         "prompt"),
        ({"prompt": ["a", "b"], "best_of": 130}, "2 prompts x 130 choices is 260 completions; at most 256 in one "
         "request", "prompt"),
        ({"prompt": "a", "best_of": 2, "stream": True}, "best_of (2) > n (1) cannot be streamed: the best choices "
         "are known only once every candidate finished", "best_of"),
        ({"prompt": "a", "prompt_logprobs": 1},
         "prompt_logprobs is not supported: use echo with logprobs on /v1/completions", "prompt_logprobs"),
    ],
)
def test_unsupported_completion_bodies(body: dict, message: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate(body).to_inputs()[0]
    assert (info.value.message, info.value.param) == (message, param)


@pytest.mark.parametrize(("model", "base"), [(CompletionRequest, {"prompt": "x"}),
                                             (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]})])
def test_stream_options_need_stream(model, base: dict) -> None:
    """As OpenAI and vLLM: stream_options without stream is a 400, not silently ignored."""
    for stream in ({}, {"stream": False}):
        with pytest.raises(InvalidRequestError) as info:
            model.model_validate({**base, **stream, "stream_options": {"include_usage": True}}).to_inputs()
        assert (info.value.message, info.value.param) == (
            "stream_options is only allowed when stream is true", "stream_options")
    assert model.model_validate({**base, "stream_options": None}).to_inputs()[0].n == 1
    assert model.model_validate({**base, "stream": True, "stream_options": {}}).include_usage is False


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ({"role": "user", "content": None},
         'messages.1.content is required on a "user" message (text or a list of content parts), got null'),
        ({"role": "system", "content": None},
         'messages.1.content is required on a "system" message (text or a list of content parts), got null'),
        ({"role": "developer", "content": None},
         'messages.1.content is required on a "developer" message (text or a list of content parts), got null'),
        ({"role": "user"}, 'messages.1.content is required on a "user" message (text or a list of content parts)'),
    ],
)
def test_null_content_is_refused_outside_assistant_messages(message: dict, error: str) -> None:
    body = {"messages": [{"role": "user", "content": "x"}, message]}
    with pytest.raises(InvalidRequestError) as info:
        ChatCompletionRequest.model_validate(body).to_inputs()
    assert (info.value.message, info.value.param) == (error, "messages.1.content")


def test_an_assistant_message_of_tool_calls_may_have_null_content() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "1"}]}
    request = ChatCompletionRequest.model_validate(body).to_inputs()[0]
    assert request.messages[1] == {"role": "assistant", "content": "", "tool_calls": [call]}


def test_chat_content_parts_and_max_completion_tokens() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 9}
    )
    request = body.to_inputs()[0]
    assert (request.messages, request.max_tokens) == (({"role": "user", "content": "ab"},), 9)
    same = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 9, "max_completion_tokens": 9}
    assert ChatCompletionRequest.model_validate(same).to_inputs()[0].max_tokens == 9


def test_max_tokens_and_max_completion_tokens_that_disagree_are_refused() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "a"}], "max_tokens": 5, "max_completion_tokens": 3})
    with pytest.raises(InvalidRequestError) as err:
        body.to_inputs()
    assert (err.value.message, err.value.param) == (
        "max_tokens (5) and max_completion_tokens (3) disagree; send one of them", "max_completion_tokens")


def test_n_out_of_range_names_n_before_the_choice_count() -> None:
    body = CompletionRequest.model_validate({"prompt": "x", "n": 1000})
    with pytest.raises(InvalidRequestError) as err:
        body.to_inputs()
    assert (err.value.message, err.value.param) == ("n must be in [1, 64], got 1000", "n")


def test_chat_image_part_is_refused() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(InvalidRequestError, match='only text content parts are supported, got "image_url"'):
        body.to_inputs()[0]


def test_sampling_extras_and_completion_logprobs() -> None:
    request = CompletionRequest.model_validate(
        {"prompt": "hi", "n": 3, "logprobs": 2, "min_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": None,
         "repetition_penalty": 1.2}
    ).to_inputs()[0]
    params = request.to_sampling_params(8)
    assert (request.n, params.logprobs, params.min_tokens) == (3, 2, 4)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, 0.0, 1.2)
    plain = CompletionRequest(prompt="hi").to_inputs()[0]
    assert (plain.to_sampling_params(16).logprobs, plain.to_sampling_params(16).repetition_penalty, plain.n) == (
        None, 1.0, 1)


@pytest.mark.parametrize(
    ("body", "logprobs"),
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": False}, None)],
)
def test_chat_logprobs_flag_and_top_logprobs(body: dict, logprobs: int | None) -> None:
    messages = [{"role": "user", "content": "hi"}]
    request = ChatCompletionRequest.model_validate({"messages": messages, **body}).to_inputs()[0]
    assert request.to_sampling_params(16).logprobs == logprobs


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
    ],
)
def test_chat_top_logprobs_refused(body: dict, message: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(InvalidRequestError) as info:
        request.to_inputs()[0]
    assert (info.value.message, info.value.param) == (message, "top_logprobs")


def body_error_of(model, body, json_body: bool = True) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    error = body_error(info.value.errors(), json_body)
    return error.message, error.param


@pytest.mark.parametrize(
    ("model", "body", "message", "param"),
    [
        (CompletionRequest, {"prompt": "x", "temprature": 0}, "unrecognized request argument: temprature",
         "temprature"),
        (CompletionRequest, {"prompt": "x", "max_token": 2, "temprature": 0},
         "unrecognized request arguments: max_token, temprature", "max_token"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "nmae": "a"}]},
         "unrecognized request argument: messages.0.nmae", "messages.0.nmae"),
        (ChatCompletionRequest, {"messages": [], "stream_options": {"include_usage": True, "continuous": True}},
         "unrecognized request argument: stream_options.continuous", "stream_options.continuous"),
        (CompletionRequest, {"prompt": "x", "stream": "yes"}, 'stream: Input should be a valid boolean, got "yes"',
         "stream"),
        (CompletionRequest, {"prompt": "x", "ignore_eos": 1}, "ignore_eos: Input should be a valid boolean, got 1",
         "ignore_eos"),
        (ChatCompletionRequest, {"messages": [], "logprobs": "true"},
         'logprobs: Input should be a valid boolean, got "true"', "logprobs"),
        (CompletionRequest, {"prompt": None},
         "prompt: expected one of str, list[int], list[str], list[list[int]], got null", "prompt"),
        (CompletionRequest, {"prompt": [1, True]},
         "prompt: expected one of str, list[int], list[str], list[list[int]], got [1, true]", "prompt"),
        (CompletionRequest, {"prompt": "x", "model": 5}, "model: Input should be a valid string, got 5", "model"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": False}},
         "metadata.k: Input should be a valid string, got false", "metadata.k"),
        (CompletionRequest, {"prompt": 42}, "prompt: expected one of str, list[int], list[str], list[list[int]], got 42",
         "prompt"),
        (CompletionRequest, {"prompt": "x", "stop": 5}, "stop: expected one of str, list[str], got 5", "stop"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": 7}]},
         "messages.0.content: expected one of str, list[ContentPart], got 7", "messages.0.content"),
        (CompletionRequest, {"prompt": "x", "max_tokens": "ten"},
         'max_tokens: Input should be a valid integer, got "ten"', "max_tokens"),
        (CompletionRequest, {"max_tokens": 3}, "prompt: Field required", "prompt"),
        (CompletionRequest, [1, 2], "the request body must be a JSON object", None),
        (CompletionRequest, {"prompt": "x", "\ud800": 1},
         "a field name is not valid Unicode (it holds a lone UTF-16 surrogate)", None),
    ],
)
def test_body_errors_name_the_field(model, body, message: str, param: str | None) -> None:
    assert body_error_of(model, body) == (message, param)


def test_form_encoded_body_hints_at_the_content_type() -> None:
    assert body_error_of(CompletionRequest, b"prompt=hi", json_body=False) == (
        "the request body must be a JSON object (send it with Content-Type: application/json)", None)


@pytest.mark.parametrize(
    ("model", "body", "message", "param"),
    [
        (CompletionRequest, {"suffix": "end"}, "suffix is not supported (only null or \"\" is accepted), got \"end\"",
         "suffix"),
        (CompletionRequest, {"logit_bias": {"50256": -100}},
         "logit_bias is not supported (only {} is accepted), got {\"50256\": -100}", "logit_bias"),
        (ChatCompletionRequest, {"functions": [{"name": "f"}]},
         "functions is not supported (only [] is accepted), got [{\"name\": \"f\"}]", "functions"),
        (ChatCompletionRequest, {"modalities": ["text", "audio"]},
         "modalities is not supported (only [\"text\"] is accepted), got [\"text\", \"audio\"]", "modalities"),
        (ChatCompletionRequest, {"messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
         "messages.0.function_call is not supported (only null is accepted), got {\"name\": \"f\"}",
         "messages.0.function_call"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": 1}]}]},
         "unrecognized request argument: messages.0.content.0.x", "messages.0.content.0"),
    ],
)
def test_unsupported_fields_with_a_value_are_refused(model, body: dict, message: str, param: str) -> None:
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(InvalidRequestError) as info:
        model.model_validate({**base, **body}).to_inputs()[0]
    assert (info.value.message, info.value.param) == (message, param)


def test_unsupported_fields_at_their_defaults_and_metadata_are_accepted() -> None:
    completion = {"prompt": "x", "echo": False, "suffix": None, "best_of": 1, "logit_bias": {}, "user": "u",
                  "top_k": 3, "min_tokens": 1, "repetition_penalty": 1.1, "ignore_eos": True, "stop_token_ids": [2]}
    assert CompletionRequest.model_validate(completion).to_inputs()[0].to_sampling_params(16).top_k == 3
    chat = {"messages": [{"role": "system", "content": "s", "name": "n"}, {"role": "user", "content": "x"}],
            "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "parallel_tool_calls": True,
            "store": False, "metadata": {"k": "v"}, "service_tier": "auto", "modalities": ["text"],
            "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    request = ChatCompletionRequest.model_validate(chat).to_inputs()[0]
    assert request.messages == ({"role": "system", "content": "s"}, {"role": "user", "content": "x"})


def scalar_fields(model: type[BaseModel], prefix: str = "") -> dict[str, type]:
    """Dotted name -> int, float or bool of every field typed so (optional or not), nested
    models included (``stream_options.include_usage``)."""
    fields = {}
    for name, field in model.model_fields.items():
        for arg in typing.get_args(field.annotation) or (field.annotation,):
            if arg in (int, float, bool):
                fields[prefix + name] = arg
            elif isinstance(arg, type) and issubclass(arg, BaseModel):
                fields.update(scalar_fields(arg, f"{prefix}{name}."))
    return fields


COMMON_SCALARS = {
    "max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "seed": int, "n": int,
    "ignore_eos": bool, "min_tokens": int, "presence_penalty": float, "frequency_penalty": float,
    "repetition_penalty": float, "min_p": float, "prompt_logprobs": int, "stream": bool,
    "stream_options.include_usage": bool, "stream_options.include_obfuscation": bool, "skip_special_tokens": bool,
    "response_format.json_schema.strict": bool, "structured_outputs.json_object": bool,
}


def test_every_numeric_and_boolean_field_is_listed() -> None:
    assert scalar_fields(CompletionRequest) == {**COMMON_SCALARS, "logprobs": int, "echo": bool, "best_of": int,
                                                "add_special_tokens": bool}
    assert scalar_fields(ChatCompletionRequest) == {**COMMON_SCALARS, "max_completion_tokens": int, "logprobs": bool,
                                                    "top_logprobs": int, "parallel_tool_calls": bool}


# What each type refuses, and how the message quotes it: numbers as strings, booleans for
# numbers, 0/1 and strings for booleans.
WRONG_VALUES = {int: [("5", '"5"'), (True, "true"), (2.5, "2.5"), (2.0, "2.0")],
                float: [("0.5", '"0.5"'), (True, "true")], bool: [(0, "0"), (1, "1"), ("true", '"true"')]}
TYPE_NAMES = {int: "integer", float: "number", bool: "boolean"}


def _body_with(name: str, value) -> dict:
    """``{"a": value}`` for ``a``, ``{"a": {"b": value}}`` for ``a.b``."""
    head, _, rest = name.partition(".")
    return {head: _body_with(rest, value) if rest else value}


# Nested fields beside required ones: the rest of a valid value around them.
AROUND = {"response_format.json_schema.strict": lambda v: {
    "response_format": {"type": "json_schema", "json_schema": {"name": "p", "strict": v}}}}


@pytest.mark.parametrize(
    ("model", "name", "value", "quoted"),
    [(model, name, value, quoted) for model in (CompletionRequest, ChatCompletionRequest)
     for name, kind in scalar_fields(model).items() for value, quoted in WRONG_VALUES[kind]],
)
def test_scalar_fields_have_strict_types(model, name: str, value, quoted: str) -> None:
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    kind = scalar_fields(model)[name]
    assert body_error_of(model, {**base, **AROUND.get(name, lambda v: _body_with(name, v))(value)}) == (
        f"{name}: Input should be a valid {TYPE_NAMES[kind]}, got {quoted}", name)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"prompt": "x", "stop_token_ids": [2, "5"]}, 'stop_token_ids.1: Input should be a valid integer, got "5"',
         "stop_token_ids.1"),
        ({"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0: Input should be a valid integer, got true",
         "stop_token_ids.0"),
    ],
)
def test_token_id_lists_have_strict_types(body: dict, message: str, param: str) -> None:
    assert body_error_of(CompletionRequest, body) == (message, param)


def test_an_integer_is_a_valid_float() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "temperature": 1, "top_p": 1}).to_inputs()[0]
    params = request.to_sampling_params(16)
    assert (params.temperature, params.top_p) == (1.0, 1.0)
    assert type(params.temperature) is float and type(params.top_p) is float


def test_quoted_strings_stay_readable_and_encodable() -> None:
    message, _ = body_error_of(CompletionRequest, {"prompt": "x", "model": ["é", "\ud800"]})
    assert message == 'model: Input should be a valid string, got ["é", "\\ud800"]'
    message.encode("utf-8")  # the error body must encode: the lone surrogate is escaped


def test_a_list_of_prompts_is_one_request_each_with_the_completion_options() -> None:
    body = CompletionRequest.model_validate({"prompt": ["a", "b"], "n": 2, "best_of": 3, "echo": True,
                                             "add_special_tokens": False, "skip_special_tokens": False, "min_p": 0.1})
    inputs = body.to_inputs()
    assert [(r.prompt, r.n, r.best_of, r.add_special_tokens, r.skip_special_tokens) for r in inputs] == [
        ("a", 2, 3, False, False), ("b", 2, 3, False, False)]
    assert inputs[0].sampling["min_p"] == 0.1
    ids = CompletionRequest.model_validate({"prompt": [[1, 2], [3]]}).to_inputs()
    assert [r.prompt_token_ids for r in ids] == [(1, 2), (3,)]
    plain = CompletionRequest.model_validate({"prompt": "a"}).to_inputs()[0]
    assert (plain.best_of, plain.add_special_tokens, plain.skip_special_tokens) == (None, True, True)
    echoed = CompletionRequest.model_validate({"prompt": "a", "echo": True, "logprobs": 2}).to_inputs()[0]
    assert (echoed.sampling["logprobs"], echoed.sampling["prompt_logprobs"]) == (2, 2)
    assert plain.sampling["prompt_logprobs"] is None


def test_chat_template_kwargs_reach_the_chat_options() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"enable_thinking": False}}
    request = ChatCompletionRequest.model_validate(body).to_inputs()[0]
    assert request.chat.template_kwargs == {"enable_thinking": False}
    assert (request.chat.add_generation_prompt, request.chat.add_special_tokens) == (True, False)
