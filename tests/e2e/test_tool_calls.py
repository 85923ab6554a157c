"""Tool calls on the real model with the official ``openai`` client, disaggregated and colocated:
``tool_choice: "required"`` and a named function return calls whose arguments validate against
the function's JSON schema (the grammar enforces it even on the 135M model), streamed and not;
a tool result fed back yields the assistant's answer, token for token the reference's."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from router.api.tools import template_message
from router.chat_templates import bundled_template
from tests import reference

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                   "unit": {"enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"]}
TIME_PARAMS = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
               "required": ["timezone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city.",
                                      "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a timezone.",
                                      "parameters": TIME_PARAMS}},
]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
WITH_RESULT = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [CALL]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18, "sky": "sunny"}'}]
MAX_TOKENS = 96


@pytest.fixture(params=["disaggregated", "colocated"])
def client(request, cluster, colocated_cluster):
    """A client of the shared disaggregated or colocated cluster (tests/e2e/conftest.py; both
    named here, so each is stopped only after the last test of this module)."""
    target = cluster if request.param == "disaggregated" else colocated_cluster
    with openai.OpenAI(base_url=f"{target.http_url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def assert_valid_calls(message, names: set[str]) -> None:
    """Each call names one of ``names`` and its arguments validate against that function's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function" and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def create(client, stream: bool, **kwargs):
    """The reply, whole or assembled from the stream by the client."""
    kwargs = dict(model=MODEL, tools=TOOLS, max_tokens=MAX_TOKENS, temperature=0, **kwargs)
    if not stream:
        return client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as events:
        return events.get_final_completion()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_forced_calls_validate_against_the_schema(client, tool_choice: str, stream: bool) -> None:
    if tool_choice == "named":
        reply = create(client, stream, messages=QUESTION, tool_choice={"type": "function",
                                                                        "function": {"name": "get_time"}})
    else:
        reply = create(client, stream, messages=QUESTION, tool_choice="required", parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(reply.choices[0].message.tool_calls) == 1
    assert_valid_calls(reply.choices[0].message, {"get_time"} if tool_choice == "named" else set(SCHEMAS))


def test_required_with_parallel_calls_returns_every_complete_call_valid(client) -> None:
    """With parallel calls the grammar lets the array grow: the 135M model keeps adding calls,
    possibly until max_tokens; every complete one is returned and validates."""
    reply = create(client, False, messages=QUESTION, tool_choice="required")
    assert reply.choices[0].finish_reason in ("tool_calls", "length")
    assert_valid_calls(reply.choices[0].message, set(SCHEMAS))


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_tool_result_fed_back_yields_the_answer(client, tool_choice: str) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=WITH_RESULT, tools=TOOLS, tool_choice=tool_choice,
                                           max_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.tool_calls) == ("stop", None)
    # The prompt the router renders (the bundled tool template; the tools listed unless "none"),
    # answered greedily by the reference.
    tokenizer = reference.tokenizer()
    prompt = tokenizer.apply_chat_template(
        [template_message(m) for m in WITH_RESULT], tools=TOOLS if tool_choice == "auto" else None,
        chat_template=bundled_template("hermes"), add_generation_prompt=True, return_dict=False)
    expected = reference.hf_greedy(list(prompt), MAX_TOKENS)
    assert choice.message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert choice.message.content.strip()
