"""Tools on the chat API: each refusal's exact message and param, what each tool_choice asks of
the prompt, the grammar and the parser, and the grammar's schema compiled by the engine's
grammar library."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from core.model_source import DEFAULT_MODEL
from core.structured_output import StructuredOutputSpec
from router.api.openai_requests import ChatCompletionRequest, body_error
from router.api.tools import ToolRequest, tool_request
from router.api.validation import InvalidRequestError, Validator
from router.output.tool_calls import ToolCallFormat

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


def to_input(**body):
    return ChatCompletionRequest.model_validate({"messages": [USER], **body}).to_input()


def refusal(**body) -> tuple[str, str]:
    """(message, param) of the 400 the API answers: the body's shape (pydantic), then the tools."""
    try:
        to_input(**body)
    except ValidationError as err:
        error = body_error(list(err.errors()), json_body=True)
    except InvalidRequestError as err:
        error = err
    else:
        raise AssertionError("not refused")
    return error.message, error.param


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
         'tool_choice names function "get_wether", which is not among the tools ("get_weather")',
         "tool_choice.function.name"),
        ({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "f"}}},
         'tool_choice names function "f", which is not among the tools ("get_weather", "get_time")',
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, 'tool_choice "required" needs tools, and the request has none', "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
         'tool_choice {"type": "function", "function": {"name": "get_weather"}} needs tools, and the request has none',
         "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "always"},
         'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
         'got "always"', "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "properties": {"a": {"type": "strin"}}}}}]},
         "tools.0.function.parameters is not a valid JSON schema: the schema is invalid at properties/a/type: "
         "'strin' is not valid under any of the given schemas", "tools.0.function.parameters"),
        ({"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
         'tools.1.function.parameters must describe an object ("type": "object"), got "string"',
         "tools.1.function.parameters"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
         'tools.0.function.name must be 1 to 64 letters, digits, underscores or dashes, got "get weather"',
         "tools.0.function.name"),
        ({"tools": [TIME, WEATHER, TIME]}, 'tools.2.function.name "get_time" is already the name of tools.0',
         "tools.2.function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]},
         "tools.0.type: Input should be 'function', got \"retrieval\"", "tools.0.type"),
    ],
)
def test_bad_tools_and_tool_choices_are_refused(body: dict, message: str, param: str) -> None:
    assert refusal(**body) == (message, param)


@pytest.fixture(scope="module")
def validator(tokenizer) -> Validator:
    return Validator(tokenizer, DEFAULT_MODEL, 1024, default_max_tokens=16)


@pytest.mark.parametrize(
    ("messages", "message", "param"),
    [
        ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
          {"role": "tool", "tool_call_id": "call_2", "content": "18 C"}],
         'messages.2.tool_call_id "call_2" matches no tool call of an earlier assistant message',
         "messages.2.tool_call_id"),
        ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
          {"role": "assistant", "content": None, "tool_calls": [CALL]}],
         'messages.1.tool_call_id "call_1" matches no tool call of an earlier assistant message',
         "messages.1.tool_call_id"),
        ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]}, {"role": "tool", "content": "18 C"}],
         'messages.2.tool_call_id is required on a "tool" message', "messages.2.tool_call_id"),
        ([{**USER, "tool_calls": [CALL]}],
         'messages.0.tool_calls is only allowed on an "assistant" message, got role "user"', "messages.0.tool_calls"),
        ([{**USER, "tool_call_id": "call_1"}],
         'messages.0.tool_call_id is only allowed on a "tool" message, got role "user"', "messages.0.tool_call_id"),
        ([USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "city=Paris"}}]}],
         'messages.1.tool_calls.0.function.arguments must be a JSON object as text, got "city=Paris"',
         "messages.1.tool_calls.0.function.arguments"),
    ],
)
def test_tool_messages_must_answer_an_earlier_call(validator: Validator, messages, message: str, param: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": messages, "tools": [WEATHER]}).to_input()
    with pytest.raises(InvalidRequestError) as info:
        validator.validate(request)
    assert (info.value.message, info.value.param) == (message, param)


def test_without_tools_none_and_auto_mean_no_tools() -> None:
    for body in ({}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": [], "tool_choice": "auto"}):
        request = to_input(**body)
        assert (request.tools, request.sampling["structured_outputs"], request.structured_param) == (None, None, None)


def test_each_tool_choice_sets_prompt_grammar_and_parser() -> None:
    auto = to_input(tools=[WEATHER, TIME]).tools
    assert auto == ToolRequest(
        (WEATHER, {"type": "function", "function": {"name": "get_time",
                                                    "parameters": {"type": "object", "properties": {}}}}), "auto")
    assert (auto.prompt_tools, auto.output_format("hermes"), auto.structured_output()) == (
        list(auto.tools), ToolCallFormat("hermes"), None)
    none = tool_request([WEATHER], "none", None)
    assert (none.prompt_tools, none.output_format("hermes"), none.structured_output()) == (None, None, None)
    named = to_input(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tools.output_format("hermes") == ToolCallFormat("named", "get_weather")
    assert named.sampling["structured_outputs"] == StructuredOutputSpec("json_schema", json.dumps(WEATHER_PARAMS),
                                                                        strict=True)
    required = to_input(tools=[WEATHER, TIME], tool_choice="required")
    assert required.tools.output_format("hermes") == ToolCallFormat("json")
    calls = [{"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_PARAMS},
              "required": ["name", "arguments"], "additionalProperties": False},
             {"type": "object", "properties": {"name": {"const": "get_time"},
                                               "arguments": {"type": "object", "properties": {}}},
              "required": ["name", "arguments"], "additionalProperties": False}]
    assert json.loads(required.sampling["structured_outputs"].value) == {
        "type": "array", "items": {"anyOf": calls}, "minItems": 1}
    single = to_input(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.sampling["structured_outputs"].value) == calls[0]
    # A worker's refusal of the grammar names the field it came from.
    assert (named.structured_param, required.structured_param) == ("tools.0.function.parameters", "tools")
    assert to_input(tools=[TIME, WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
                    ).structured_param == "tools.1.function.parameters"


def test_a_forced_call_takes_no_other_structured_output() -> None:
    assert refusal(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}) == (
        'response_format cannot be combined with tool_choice "required": the calls follow the functions\' '
        "parameters", "response_format")
    assert refusal(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                   guided_regex="a+") == (
        'guided_regex cannot be combined with tool_choice {"type": "function", "function": {"name": "get_weather"}}: '
        "the calls follow the functions' parameters", "guided_regex")
    # "auto" has no grammar of its own: a structured output applies to the whole text.
    request = to_input(tools=[WEATHER], response_format={"type": "json_object"})
    assert request.sampling["structured_outputs"] == StructuredOutputSpec("json_object")


def test_refs_of_a_tool_keep_pointing_at_its_own_defs() -> None:
    params = {"type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}, "again": {"$ref": "#"}},
              "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    tools = ToolRequest(({"type": "function", "function": {"name": "go", "parameters": params}},), "required",
                        parallel_tool_calls=False)
    assert tools.calls_schema() == {
        "type": "object", "properties": {"name": {"const": "go"}, "arguments": {"$ref": "#/$defs/go.parameters"}},
        "required": ["name", "arguments"], "additionalProperties": False,
        "$defs": {"go.Place": {"type": "object", "properties": {"city": {"type": "string"}}},
                  "go.parameters": {"type": "object", "properties": {"where": {"$ref": "#/$defs/go.Place"},
                                                                     "again": {"$ref": "#/$defs/go.parameters"}}}}}


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "text", "accepted"),
    [
        ("required", True, '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', True),
        ("required", True, '[{"name": "get_time", "arguments": {}}, '
                           '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "fahrenheit"}}]', True),
        ("required", True, "[]", False),
        ("required", True, '[{"name": "get_date", "arguments": {}}]', False),
        ("required", True, '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}]', False),
        ("required", False, '{"name": "get_time", "arguments": {}}', True),
        ("required", False, '[{"name": "get_time", "arguments": {}}]', False),
        ({"type": "function", "function": {"name": "get_weather"}}, True, '{"city": "Paris", "unit": "celsius"}', True),
        ({"type": "function", "function": {"name": "get_weather"}}, True, '{"city": "Paris"}', False),
    ],
)
def test_the_grammar_accepts_exactly_the_calls_the_tools_allow(tool_choice, parallel: bool, text: str,
                                                                  accepted: bool) -> None:
    xgrammar_testing = pytest.importorskip("xgrammar.testing")
    import xgrammar

    spec = to_input(tools=[WEATHER, TIME], tool_choice=tool_choice, parallel_tool_calls=parallel).sampling[
        "structured_outputs"]
    # As engine.structured_output compiles a json_schema spec.
    grammar = xgrammar.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=spec.strict)
    assert xgrammar_testing._is_grammar_accept_string(grammar, text) is accepted
