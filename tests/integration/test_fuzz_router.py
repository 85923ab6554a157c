"""Bad input at scale: a property-based fuzzer (hypothesis) sends 1,200 generated
requests to the real router's HTTP and gRPC front-ends (scripted fake workers behind it, the
fixture of test_router.py): wrong types, huge numbers, deep JSON, odd Unicode, token ids out of
range, stop lists, n and logprobs combinations, truncated bodies, unknown fields.

For every one: no 5xx, no dropped connection, a complete answer (a JSON body, or an SSE stream
ending with ``[DONE]``) or a 4xx naming the offending field (``error.param``, or a message about
the request body itself); gRPC: OK or INVALID_ARGUMENT / NOT_FOUND / RESOURCE_EXHAUSTED with a
message. After each batch a good request is served. Slow-loris uploads run while a good request
is served. Hypothesis is derandomized (the same cases every run) and keeps no database.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import Counter

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.model_source import DEFAULT_MODEL
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.test_router import Cluster, cluster  # noqa: F401  (the module fixture)

pytestmark = pytest.mark.asyncio(loop_scope="module")
HTTP_BATCHES, HTTP_CASES = 4, 250  # 1,000 HTTP requests
GRPC_CASES = 200
FUZZ = settings(max_examples=HTTP_CASES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))
SEND_TIMEOUT_S = 30.0

# Anything JSON can hold, nested a few levels (deep JSON).
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
odd_text = st.text(st.characters(codec="utf-8"), max_size=40) | st.sampled_from(
    ["", "\u0000", "\ud7ff\ue000", "👋🏽" * 10, "\u202e evil", "é" * 300, "<|endoftext|>", "a\r\nb"])
token_ids = st.lists(st.integers(-5, 60_000) | st.just(2**31), max_size=12)


def field(valid, wild_share: float = 0.3):
    """Mostly plausible values, sometimes anything JSON can hold."""
    return st.one_of(valid, json_values) if wild_share else valid


COMMON = {
    "model": field(st.sampled_from([DEFAULT_MODEL, "other-model", ""])),
    "max_tokens": field(st.integers(-3, 10**12)),
    "temperature": field(st.floats(-1, 3) | st.sampled_from([float("inf"), 1e308])),
    "top_p": field(st.floats(-0.5, 1.5)),
    "top_k": field(st.integers(-3, 10**6)),
    "n": field(st.integers(-1, 70)),
    "seed": field(st.integers(-1, 2**65)),
    "stop": field(st.lists(odd_text, max_size=6) | odd_text),
    "stream": st.booleans(),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(st.integers(-2, 100)),
    "presence_penalty": field(st.floats(-3, 3)),
    "frequency_penalty": field(st.floats(-3, 3)),
    "repetition_penalty": field(st.floats(-1, 3)),
    "stop_token_ids": field(token_ids),
}
COMPLETION = {**COMMON, "prompt": field(odd_text | token_ids | st.lists(odd_text, max_size=3)),
              "logprobs": field(st.integers(-1, 30))}
# Tools: names valid or not, parameters a schema or anything, tool_choice naming one or not, and
# messages with calls and answers that match or not.
function_names = st.sampled_from(["f", "g", "bad name", ""])
tool_parameters = st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "strin"])},
                                        optional={"properties": json_values, "required": json_values})
tools = st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["function", "retrieval"]), "function": st.fixed_dictionaries(
        {"name": function_names}, optional={"parameters": field(tool_parameters), "description": odd_text,
                                            "strict": st.booleans()})}), max_size=3)
tool_choices = st.sampled_from(["none", "auto", "required", "any"]) | st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": function_names})})
tool_calls = st.lists(st.fixed_dictionaries({"id": st.sampled_from(["c1", "c2"]), "type": st.just("function"),
                                             "function": st.fixed_dictionaries({"name": function_names,
                                                                                "arguments": odd_text})}), max_size=2)
CHAT = {**COMMON, "logprobs": field(st.booleans()), "top_logprobs": field(st.integers(-1, 30)),
        "messages": field(st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]), "content": odd_text},
            optional={"tool_calls": field(tool_calls), "tool_call_id": field(st.sampled_from(["c1", "c2"]))}),
            max_size=3)),
        "tools": field(tools), "tool_choice": field(tool_choices), "parallel_tool_calls": field(st.booleans())}


def bodies(fields: dict, prompt_field: str) -> st.SearchStrategy[dict]:
    """The prompt (``prompt_field``) always, any subset of the other fields, and sometimes
    fields the API does not have."""
    optional = {name: strategy for name, strategy in fields.items() if name not in ("model", prompt_field)}
    extra = st.dictionaries(st.sampled_from(["foo", "best_of", "echo", "suffix", "user"]), json_values, max_size=1)
    base = st.fixed_dictionaries({prompt_field: fields[prompt_field]}, optional=optional)
    return st.builds(lambda body, more: {"model": DEFAULT_MODEL, **body, **more}, base,
                     st.one_of(st.just({}), st.just({}), extra))


# A request: path, raw body bytes (a JSON body, maybe cut short or not JSON at all).
requests = st.one_of(
    st.tuples(st.just("/v1/completions"), bodies(COMPLETION, "prompt")),
    st.tuples(st.just("/v1/chat/completions"), bodies(CHAT, "messages")),
).flatmap(lambda pair: st.tuples(st.just(pair[0]), st.sampled_from(["whole", "cut", "raw"]),
                                 st.just(json.dumps(pair[1]).encode()), st.integers(0, 200), st.binary(max_size=40)))


def body_bytes(mode: str, whole: bytes, cut_at: int, raw: bytes) -> bytes:
    return whole if mode == "whole" else whole[: cut_at % max(1, len(whole))] if mode == "cut" else raw


def check_http(http: httpx.Client, path: str, body: bytes, stream: bool) -> int:
    """One request; asserts the response is complete and never a 5xx (see the module docstring).
    Returns its status."""
    with http.stream("POST", path, content=body, headers={"content-type": "application/json"}) as response:
        data = response.read()
    assert response.status_code < 500, (path, body[:300], response.status_code, data[:300])
    if response.status_code == 200:
        if stream and response.headers["content-type"].startswith("text/event-stream"):
            assert data.rstrip().endswith(b"data: [DONE]"), (body[:300], data[-300:])
        else:
            assert json.loads(data)["choices"], (body[:300], data[:300])
        return 200
    error = json.loads(data)["error"]
    named = error.get("param") or "body" in error["message"] or "JSON" in error["message"]
    assert named and error["message"], (path, body[:300], response.status_code, error)
    return response.status_code


def good_request(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Say hello", "max_tokens": 8})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text


def fuzz_http(base_url: str) -> Counter:
    """HTTP_BATCHES batches of HTTP_CASES generated requests, a good request after each (in a
    thread: the router runs on the test's event loop). Returns the count of each status."""
    statuses: Counter = Counter()
    with httpx.Client(base_url=base_url, timeout=SEND_TIMEOUT_S) as http:
        for batch in range(HTTP_BATCHES):
            @FUZZ
            @given(requests)
            def one(case) -> None:
                path, mode, whole, cut_at, raw = case
                stream = b'"stream": true' in whole
                statuses[check_http(http, path, body_bytes(mode, whole, cut_at + batch, raw), stream)] += 1

            one()
            good_request(http)
    return statuses


grpc_requests = st.builds(
    lambda prompt, params, stop, n, request_id, model: router_pb2.GenerateRequest(
        model=model, sampling_params=params, stop=stop, n=n, request_id=request_id, **prompt),
    st.one_of(
        st.builds(lambda t: {"text": t}, odd_text),
        st.builds(lambda ids: {"token_ids": router_pb2.TokenIds(ids=[i for i in ids if -2**31 <= i < 2**31])}, token_ids),
        st.builds(lambda ms: {"chat": router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role=r, content=c)
                                                                        for r, c in ms])},
                  st.lists(st.tuples(st.sampled_from(["user", "system", "x", ""]), odd_text), max_size=3)),
    ),
    st.builds(lambda t, p, k, m, lp, mt: common_pb2.SamplingParams(
        temperature=t, top_p=p, top_k=k, max_tokens=m, min_tokens=mt, **({} if lp is None else {"logprobs": lp})),
        st.floats(-1, 3, width=32), st.floats(-1, 2, width=32), st.integers(-2**31, 2**31 - 1),
        st.integers(-2**31, 2**31 - 1), st.none() | st.integers(-3, 40), st.integers(0, 2**32 - 1)),
    st.lists(odd_text, max_size=5), st.integers(0, 100), st.text(max_size=140), st.sampled_from(["", DEFAULT_MODEL, "x"]),
)
GRPC_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED}


def fuzz_grpc(address: str) -> int:
    sent = 0
    with grpc.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        @settings(FUZZ, max_examples=GRPC_CASES)
        @given(grpc_requests)
        def one(request) -> None:
            nonlocal sent
            sent += 1
            try:
                events = list(stub.Generate(request, timeout=SEND_TIMEOUT_S))
            except grpc.RpcError as err:
                assert err.code() in GRPC_REFUSALS and err.details(), (request, err.code(), err.details())
                return
            assert events and events[-1].HasField("finished"), (request, events[-1:])

        one()
        good = router_pb2.GenerateRequest(text="Say hello", sampling_params=common_pb2.SamplingParams(max_tokens=8))
        assert list(stub.Generate(good, timeout=SEND_TIMEOUT_S))[-1].HasField("finished")
    return sent


async def test_a_thousand_generated_http_requests_get_answers_or_named_4xx(cluster: Cluster) -> None:  # noqa: F811
    cluster.script_text()
    statuses = await asyncio.to_thread(fuzz_http, str(cluster.http.base_url))
    assert sum(statuses.values()) == HTTP_BATCHES * HTTP_CASES
    assert statuses[200] and statuses[400] and set(statuses) <= {200, 400, 404, 413, 422, 429}, statuses


async def test_generated_grpc_requests_get_answers_or_refusals(cluster: Cluster) -> None:  # noqa: F811
    cluster.script_text()
    assert await asyncio.to_thread(fuzz_grpc, f"127.0.0.1:{cluster.router.grpc_port}") == GRPC_CASES


def slow_loris(port: int, num_bytes: int, started: list) -> None:
    """Sends a request's head and part of its body, then stops sending (keeps the socket open)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n" + b"{" * num_bytes)
    started.append(sock)


async def test_slow_loris_uploads_do_not_stop_good_requests(cluster: Cluster) -> None:  # noqa: F811
    cluster.script_text()
    sockets: list[socket.socket] = []
    for i in range(32):
        await asyncio.to_thread(slow_loris, cluster.router.http_port, i + 1, sockets)
    try:
        reply = await cluster.http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Say hello",
                                                                 "max_tokens": 8})
        assert reply.status_code == 200 and reply.json()["choices"][0]["text"]
    finally:
        for sock in sockets:
            sock.close()
