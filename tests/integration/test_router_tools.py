"""Tool calls through the real router (HTTP on 127.0.0.1) against scripted fake workers, read
with the official ``openai`` client: the text the fakes generate comes back as
``message.tool_calls`` / assembled ``delta.tool_calls``, the grammar of ``required`` and of a
named function reaches the workers, and refusals are 400s naming the field."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest
import pytest_asyncio

from core.model_source import DEFAULT_MODEL, resolve_model
from core.registry import WorkerRegistry
from router.config import RouterConfig
from router.server import RouterServer
from router.tokenizer import load_tokenizer
from tests.integration.test_router import Cluster, Fakes, start_fake_workers

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.asyncio(loop_scope="module")

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")
HERMES_TEXT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(redis_url: str):
    """A router (context 1024: the tool template's system turn is long) over the fake workers."""
    url = redis_url.rsplit("/", 1)[0] + "/4"
    fakes = Fakes()
    server, workers = await start_fake_workers(fakes)
    tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
    router = RouterServer(RouterConfig(http_port=0, grpc_port=0, redis_url=url, max_model_len=1024,
                                       shutdown_grace_s=1.0), tokenizer=tokenizer)
    await router.start()
    registry = WorkerRegistry(url)
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="unused", max_retries=0)
    cluster = Cluster(router, fakes, registry, workers, tokenizer, None)
    await cluster.register()
    yield cluster, client
    await client.close()
    await router.stop()
    await registry.redis.flushdb()
    await registry.close()
    await server.stop(0)


def calls_of(message) -> list[tuple[str, str]]:
    assert all(CALL_ID.match(c.id) and c.type == "function" for c in message.tool_calls)
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


async def test_auto_reads_hermes_blocks_whole_and_streamed(cluster) -> None:
    fakes_cluster, client = cluster
    fakes_cluster.script_text(HERMES_TEXT)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, max_tokens=100)
    choice = reply.choices[0]
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert (choice.finish_reason, choice.message.content, calls_of(choice.message)) == (
        "tool_calls", "I will check.\n", expected)
    # The prompt listed the tools (the bundled template); no grammar under "auto".
    prompt = list(fakes_cluster.fakes.prefill_requests[-1].prompt_token_ids)
    assert prompt == fakes_cluster.tokenizer.encode_chat(USER, TOOLS)
    assert not fakes_cluster.fakes.prefill_requests[-1].sampling_params.HasField("structured_outputs")

    fakes_cluster.script_text(HERMES_TEXT, chunk=2)
    async with client.chat.completions.stream(model=DEFAULT_MODEL, messages=USER, tools=TOOLS,
                                              max_tokens=100) as stream:
        chunks = [event.chunk async for event in stream if event.type == "chunk"]
        final = await stream.get_final_completion()
    assert (final.choices[0].finish_reason, final.choices[0].message.content) == ("tool_calls", "I will check.\n")
    assert calls_of(final.choices[0].message) == expected
    pieces = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    # Each call announced (id, type, name, no arguments), then its arguments.
    assert [(p.index, p.id is not None, p.function.name, p.function.arguments) for p in pieces] == [
        (0, True, "get_weather", ""), (0, False, None, '{"city": "Paris"}'), (1, True, "get_time", ""),
        (1, False, None, "{}")]


async def test_malformed_block_and_tool_choice_none_stay_content(cluster) -> None:
    fakes_cluster, client = cluster
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>'
    fakes_cluster.script_text(text)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, max_tokens=100)
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content, reply.choices[0].message.tool_calls) == (
        "stop", text, None)
    fakes_cluster.script_text(HERMES_TEXT)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, tool_choice="none",
                                                 max_tokens=100)
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == ("stop", HERMES_TEXT)
    # "none": the tools are not in the prompt.
    prompt = list(fakes_cluster.fakes.prefill_requests[-1].prompt_token_ids)
    assert prompt == fakes_cluster.tokenizer.encode_chat(USER)


async def test_named_function_streams_its_arguments_under_its_grammar(cluster) -> None:
    fakes_cluster, client = cluster
    arguments = '{"city": "Paris"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    fakes_cluster.script_text(arguments, chunk=1)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, tool_choice=named,
                                                 max_tokens=100)
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == ("tool_calls", None)
    assert calls_of(reply.choices[0].message) == [("get_weather", arguments)]
    grammar = fakes_cluster.fakes.prefill_requests[-1].sampling_params.structured_outputs
    assert (grammar.kind, json.loads(grammar.value), grammar.strict) == ("json_schema", WEATHER_PARAMS, True)

    fakes_cluster.script_text(arguments, chunk=1)
    stream = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, tool_choice=named,
                                                  max_tokens=100, stream=True)
    chunks = [chunk async for chunk in stream]
    pieces = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and CALL_ID.match(pieces[0].id)
    assert len(pieces) > 3 and "".join(p.function.arguments for p in pieces) == arguments  # piece by piece
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


async def test_required_reads_the_array_of_calls(cluster) -> None:
    fakes_cluster, client = cluster
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'
    fakes_cluster.script_text(text)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS,
                                                 tool_choice="required", max_tokens=100)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert calls_of(reply.choices[0].message) == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    grammar = fakes_cluster.fakes.prefill_requests[-1].sampling_params.structured_outputs
    assert json.loads(grammar.value)["type"] == "array"


async def test_a_tool_result_goes_into_the_prompt(cluster) -> None:
    fakes_cluster, client = cluster
    fakes_cluster.script_text("It is 18 C in Paris.")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=messages, tools=TOOLS, max_tokens=50)
    assert (reply.choices[0].finish_reason, reply.choices[0].message.content) == ("stop", "It is 18 C in Paris.")
    prompt = fakes_cluster.tokenizer.hf.decode(list(fakes_cluster.fakes.prefill_requests[-1].prompt_token_ids))
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                           "\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n18 C\n</tool_response>"
                           "<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("kwargs", "message", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_date"}}},
         'tool_choice names function "get_date", which is not among the tools ("get_weather", "get_time")',
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, 'tool_choice "required" needs tools, and the request has none', "tool_choice"),
        ({"tools": TOOLS, "messages": [*USER, {"role": "tool", "tool_call_id": "call_9", "content": "18 C"}]},
         'messages.1.tool_call_id "call_9" matches no tool call of an earlier assistant message',
         "messages.1.tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                 "required": "city"}}}]},
         "tools.0.function.parameters is not a valid JSON schema: the schema is invalid at required: "
         "'city' is not of type 'array'", "tools.0.function.parameters"),
    ],
)
async def test_refusals_are_400_naming_the_field(cluster, kwargs: dict, message: str, param: str) -> None:
    _, client = cluster
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=DEFAULT_MODEL, **{"messages": USER, **kwargs})
    assert info.value.status_code == 400
    assert (info.value.body["message"], info.value.body["param"]) == (message, param)


@pytest.mark.parametrize(("tool_choice", "param"), [
    ({"type": "function", "function": {"name": "get_time"}}, "tools.1.function.parameters"),
    ("required", "tools"),
])
async def test_a_grammar_the_worker_refuses_names_the_tools(cluster, tool_choice, param: str) -> None:
    fakes_cluster, client = cluster
    fakes_cluster.script_text("x", prefill_error=grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, tool_choice=tool_choice)
    assert (info.value.body["message"], info.value.body["param"]) == (
        "fake prefill refuses (INVALID_ARGUMENT)", param)


async def test_each_of_n_choices_has_its_own_calls(cluster) -> None:
    fakes_cluster, client = cluster
    fakes_cluster.script_text(HERMES_TEXT, chunk=4)
    reply = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, n=2, max_tokens=100)
    expected = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert [(c.index, c.finish_reason, calls_of(c.message)) for c in reply.choices] == [
        (0, "tool_calls", expected), (1, "tool_calls", expected)]
    assert len({call.id for c in reply.choices for call in c.message.tool_calls}) == 4
    fakes_cluster.script_text(HERMES_TEXT, chunk=4)
    stream = await client.chat.completions.create(model=DEFAULT_MODEL, messages=USER, tools=TOOLS, n=2,
                                                  max_tokens=100, stream=True)
    assembled: dict[int, dict[int, list[str]]] = {0: {}, 1: {}}
    async for chunk in stream:
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = assembled[choice.index].setdefault(piece.index, ["", ""])
                call[0] += piece.function.name or ""
                call[1] += piece.function.arguments or ""
    assert assembled == {i: {k: list(call) for k, call in enumerate(expected)} for i in (0, 1)}
