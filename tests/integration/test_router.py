"""The router as a real server (HTTP + gRPC on 127.0.0.1) against scripted fake workers.

Fake prefill, decode and pool servicers run in this process, registered in a real Redis; each
test scripts the tokens they return and observes what the router did to them (requests seen,
cancellations, and that no ReleaseRequest comes from the router). Synchronisation is by events
with timeouts, never sleeps.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from core.grpc_service import aio_channel
from core.model_source import DEFAULT_MODEL, resolve_model
from core.registry import WorkerInfo, WorkerRegistry
from router.config import RouterConfig
from router.server import RouterServer
from router.tokenizer import load_tokenizer
from tandem.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    kv_pool_pb2,
    kv_pool_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


CANCEL_WAIT_S = 1.0  # "well under a second" plus scheduling slack on a shared machine
MAX_MODEL_LEN = 64
TEXT = "Hello, world! 👋 世界 is here. The END is near"
EOS = 2


@dataclass
class Script:
    """What the fakes do for the next request."""

    first_token_id: int = 0
    decode_chunks: list[list[int]] = field(default_factory=list)
    finish_reason: int = common_pb2.FINISH_REASON_STOP
    num_cached_tokens: int = 16
    prefill_error: grpc.StatusCode | None = None
    decode_error: grpc.StatusCode | None = None  # after the chunks
    hang_prefill: bool = False
    hang_decode: bool = False  # after the chunks
    seed_logprob_offsets: dict[int, float] = field(default_factory=dict)  # seed -> added to every logprob


class Fakes:
    """Shared state of the fake workers: the script and what they observed."""

    def __init__(self) -> None:
        self.script = Script()
        self.pool_address = ""
        self.health: dict[str, health.aio.HealthServicer] = {}  # by role: each fake role's own health answer
        self.prefill_requests: list[prefill_worker_pb2.PrefillRequest] = []
        self.decode_requests: list[decode_worker_pb2.DecodeRequest] = []
        self.prefill_cancelled = asyncio.Event()
        self.decode_cancelled = asyncio.Event()
        self.hanging = asyncio.Event()  # a fake is parked in hang(), where it sees cancellation
        self.released: dict[str, asyncio.Event] = {}

    def reset(self, script: Script) -> None:
        self.script = script
        for event in (self.prefill_cancelled, self.decode_cancelled, self.hanging):
            event.clear()

    async def hang(self, cancelled: asyncio.Event) -> None:
        """Waits until the router cancels the RPC (grpc.aio cancels the handler's task).

        A cancellation that arrives while a streaming handler is suspended in ``yield`` is not
        raised in the handler, so tests cancel only once ``hanging`` is set.
        """
        self.hanging.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def release_event(self, request_id: str) -> asyncio.Event:
        return self.released.setdefault(request_id, asyncio.Event())


def fake_logprob(token_id: int, position: int, params: common_pb2.SamplingParams,
                 offset: float = 0.0) -> common_pb2.TokenLogprob:
    """Position p's logprob is -(p + 1) / 10 + ``offset``; its top list repeats the token
    ``logprobs`` times with falling values (enough to check shapes and order)."""
    value = -(position + 1) / 10 + offset
    top = [common_pb2.TopLogprob(token_id=token_id + k, logprob=value - k) for k in range(params.logprobs)]
    return common_pb2.TokenLogprob(token_id=token_id, logprob=value, top_logprobs=top)


def fake_prompt_logprobs(prompt_token_ids, params: common_pb2.SamplingParams) -> list[common_pb2.TokenLogprob]:
    """With ``prompt_logprobs``: prompt token k (from k = 1) has logprob -k / 100, its top list
    the token itself."""
    if not params.HasField("prompt_logprobs"):
        return []
    return [common_pb2.TokenLogprob(token_id=t, logprob=-k / 100, top_logprobs=[common_pb2.TopLogprob(
        token_id=t, logprob=-k / 100)] * params.prompt_logprobs) for k, t in enumerate(prompt_token_ids) if k]


class FakePrefill(prefill_worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, fakes: Fakes):
        self.fakes = fakes

    async def Prefill(self, request, context):
        fakes, script = self.fakes, self.fakes.script
        fakes.prefill_requests.append(request)
        if script.prefill_error is not None:
            await context.abort(script.prefill_error, f"fake prefill refuses ({script.prefill_error.name})")
        if script.hang_prefill:
            await fakes.hang(fakes.prefill_cancelled)
        manifest = common_pb2.KVManifest(
            spec_fingerprint="fake", pool_address=fakes.pool_address, num_tokens=len(request.prompt_token_ids)
        )
        response = prefill_worker_pb2.PrefillResponse(
            first_token_id=script.first_token_id, num_cached_tokens=script.num_cached_tokens, manifest=manifest
        )
        if request.sampling_params.HasField("logprobs"):
            offset = script.seed_logprob_offsets.get(request.sampling_params.seed, 0.0)
            response.first_token_logprob.CopyFrom(fake_logprob(script.first_token_id, 0, request.sampling_params, offset))
        response.prompt_logprobs.extend(fake_prompt_logprobs(request.prompt_token_ids, request.sampling_params))
        return response


class FakeDecode(decode_worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, fakes: Fakes):
        self.fakes = fakes

    async def Decode(self, request, context):
        fakes, script = self.fakes, self.fakes.script
        fakes.decode_requests.append(request)
        position, params = 1, request.sampling_params
        offset = script.seed_logprob_offsets.get(params.seed, 0.0)
        for chunk in script.decode_chunks:
            logprobs = [fake_logprob(t, position + k, params, offset) for k, t in enumerate(chunk)]
            position += len(chunk)
            tokens = decode_worker_pb2.TokenChunk(token_ids=chunk, logprobs=logprobs if params.HasField("logprobs") else [])
            if position == 1 + len(chunk) and not request.HasField("first_token_id"):  # colocated: prefilled here
                tokens.prompt_logprobs.extend(fake_prompt_logprobs(request.prompt_token_ids, params))
                tokens.num_cached_tokens = script.num_cached_tokens
            yield decode_worker_pb2.DecodeResponse(tokens=tokens)
        if script.decode_error is not None:
            await context.abort(script.decode_error, "fake decode broke")
        if script.hang_decode:
            await fakes.hang(fakes.decode_cancelled)
        num_output_tokens = 1 + sum(len(c) for c in script.decode_chunks)
        finished = decode_worker_pb2.Finished(finish_reason=script.finish_reason, num_output_tokens=num_output_tokens)
        yield decode_worker_pb2.DecodeResponse(finished=finished)


class FakePool(kv_pool_pb2_grpc.KVPoolServicer):
    def __init__(self, fakes: Fakes):
        self.fakes = fakes

    async def ReleaseRequest(self, request, context):
        self.fakes.release_event(request.request_id).set()
        return kv_pool_pb2.ReleaseRequestResponse()


@dataclass
class Cluster:
    router: RouterServer
    fakes: Fakes
    registry: WorkerRegistry
    workers: list[WorkerInfo]
    tokenizer: object
    http: httpx.AsyncClient

    async def register(self, roles=("prefill", "decode", "pool")) -> None:
        for info in self.workers:
            if info.role in roles:
                await self.fakes.health[info.role].set("", health_pb2.HealthCheckResponse.SERVING)
                await self.registry.heartbeat(info, ttl_s=600)
        await self.router.view.refresh()

    async def deregister(self, roles) -> None:
        """The workers of ``roles`` stop as real ones do: NOT_SERVING, then out of the registry (a
        worker gone from the registry that still answers SERVING is kept: a split view)."""
        for info in self.workers:
            if info.role in roles:
                await self.fakes.health[info.role].set("", health_pb2.HealthCheckResponse.NOT_SERVING)
                await self.registry.deregister(info.role, info.worker_id)
        await self.router.view.refresh()

    def script_text(self, text: str = TEXT, finish_token: int | None = EOS, chunk: int = 3, **kwargs) -> Script:
        """Scripts the fakes to generate ``text`` (then ``finish_token``), ``chunk`` tokens a message."""
        ids = self.tokenizer.encode(text) + ([finish_token] if finish_token is not None else [])
        chunks = [ids[i : i + chunk] for i in range(1, len(ids), chunk)]
        script = Script(first_token_id=ids[0], decode_chunks=chunks, **kwargs)
        self.fakes.reset(script)
        return script

    def assert_not_released(self, request_id: str) -> None:
        """The router told no pool to release ``request_id`` or an attempt of it (the router's
        worker-facing ids are ``<request_id>-<12 hex digits>``): the workers' KV connectors own
        every request's pool state (engine/kv_connector/connector.py). The fixture checks again
        once the router has stopped (its background work done)."""
        pattern = re.compile(rf"{re.escape(request_id)}(-[0-9a-f]{{12}})?")
        assert not any(pattern.fullmatch(rid) for rid in self.fakes.released), sorted(self.fakes.released)

    def address(self, role: str) -> str:
        return next(w.address for w in self.workers if w.role == role)


async def start_fake_workers(fakes: Fakes, decode: decode_worker_pb2_grpc.DecodeWorkerServicer | None = None,
                             ) -> tuple[grpc.aio.Server, list[WorkerInfo]]:
    """The fake prefill, decode (``decode``, default a FakeDecode) and pool servicers, one started
    gRPC server per role with its own health service (``fakes.health[role]``, SERVING), so a
    role's worker can be marked down or stopped without the others; returns the servers (stop
    them) and each role's WorkerInfo."""
    servicers = {"prefill": (prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server, FakePrefill(fakes)),
                 "decode": (decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server, decode or FakeDecode(fakes)),
                 "pool": (kv_pool_pb2_grpc.add_KVPoolServicer_to_server, FakePool(fakes))}
    servers, addresses = [], {}
    for role, (add, servicer) in servicers.items():
        server = grpc.aio.server()
        add(servicer, server)
        fakes.health[role] = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(fakes.health[role], server)
        addresses[role] = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        servers.append(server)
    fakes.pool_address = addresses["pool"]
    return FakeServers(servers), [WorkerInfo(f"fake-{role}", role, addresses[role]) for role in servicers]


class FakeServers:
    """The fake roles' gRPC servers, stopped together."""

    def __init__(self, servers: list[grpc.aio.Server]):
        self.servers = servers

    async def stop(self, grace: float | None) -> None:
        await asyncio.gather(*(server.stop(grace) for server in self.servers))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(redis_url: str):
    url = redis_url.rsplit("/", 1)[0] + "/3"  # a db of our own in the shared server
    fakes = Fakes()
    server, workers = await start_fake_workers(fakes)
    tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
    config = RouterConfig(http_port=0, grpc_port=0, redis_url=url, max_model_len=MAX_MODEL_LEN, shutdown_grace_s=1.0)
    router = RouterServer(config, tokenizer=tokenizer)
    await router.start()
    registry = WorkerRegistry(url)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=10.0) as http:
        cluster = Cluster(router, fakes, registry, workers, tokenizer, http)
        await cluster.register()
        yield cluster
    await router.stop()
    assert fakes.released == {}  # the router never releases pool state (see assert_not_released)
    await registry.redis.flushdb()
    await registry.close()
    await server.stop(0)


async def sse_events(response: httpx.Response) -> list:
    events = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def test_completion_stream_sse_format_usage_and_release(cluster: Cluster) -> None:
    cluster.script_text()
    body = {"model": DEFAULT_MODEL, "prompt": "Say hello", "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}}
    async with cluster.http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == TEXT
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert len({c["id"] for c in events[:-1]}) == 1
    num_generated = len(cluster.tokenizer.encode(TEXT)) + 1  # + EOS
    prompt_tokens = len(cluster.tokenizer.encode("Say hello"))
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": num_generated,
                                    "total_tokens": prompt_tokens + num_generated,
                                    "prompt_tokens_details": {"cached_tokens": 16}}
    decode = cluster.fakes.decode_requests[-1]
    assert decode.first_token_id == cluster.fakes.script.first_token_id
    assert decode.manifest.pool_address == cluster.fakes.pool_address
    cluster.assert_not_released(chunks[0]["id"])


async def test_chat_non_stream(cluster: Cluster) -> None:
    cluster.script_text("Hi there!")
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 20, "temperature": 0}
    response = await cluster.http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "Hi there!"}
    assert data["choices"][0]["finish_reason"] == "stop"
    prompt = list(cluster.fakes.prefill_requests[-1].prompt_token_ids)
    assert prompt == cluster.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert data["usage"]["prompt_tokens"] == len(prompt)
    assert data["usage"]["completion_tokens"] == len(cluster.tokenizer.encode("Hi there!")) + 1
    cluster.assert_not_released(data["id"])


async def test_chat_stream_starts_with_role(cluster: Cluster) -> None:
    cluster.script_text("Sure.")
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with cluster.http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = await sse_events(response)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Sure."
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert events[-1] == "[DONE]"


async def test_max_tokens_one_ends_at_the_first_token(cluster: Cluster) -> None:
    cluster.script_text()
    num_decodes = len(cluster.fakes.decode_requests)
    response = await cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    data = response.json()
    assert (data["choices"][0]["text"], data["choices"][0]["finish_reason"]) == ("Hello", "length")
    assert data["usage"]["completion_tokens"] == 1
    assert len(cluster.fakes.decode_requests) == num_decodes
    cluster.assert_not_released(data["id"])


async def test_stop_string_truncates_and_cancels_decode(cluster: Cluster) -> None:
    cluster.script_text(chunk=2, hang_decode=True)  # the decode stream would never end by itself
    body = {"prompt": "x", "max_tokens": 40, "stop": ["END"], "stream": True}
    async with cluster.http.stream("POST", "/v1/completions", json=body) as response:
        events = await sse_events(response)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT[: TEXT.index("END")]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    await asyncio.wait_for(cluster.fakes.decode_cancelled.wait(), CANCEL_WAIT_S)
    cluster.assert_not_released(events[0]["id"])


async def test_client_disconnect_during_prefill_cancels_it(cluster: Cluster) -> None:
    cluster.script_text(hang_prefill=True)

    async def client() -> None:
        async with cluster.http.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            await r.aread()

    task = asyncio.create_task(client())
    await asyncio.wait_for(cluster.fakes.hanging.wait(), 5.0)
    task.cancel()
    await asyncio.wait_for(cluster.fakes.prefill_cancelled.wait(), CANCEL_WAIT_S)
    cluster.assert_not_released(cluster.fakes.prefill_requests[-1].request_id)


async def test_client_disconnect_during_decode_cancels_it(cluster: Cluster) -> None:
    cluster.script_text(hang_decode=True)
    body = {"prompt": "x", "max_tokens": 40, "stream": True}
    async with cluster.http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.aiter_lines()  # held: a dropped iterator closes the connection when collected
        async for line in lines:
            if line.startswith("data: "):
                break  # got the first token
        await asyncio.wait_for(cluster.fakes.hanging.wait(), 5.0)
    # leaving the block closed the connection
    await asyncio.wait_for(cluster.fakes.decode_cancelled.wait(), CANCEL_WAIT_S)
    cluster.assert_not_released(cluster.fakes.decode_requests[-1].request_id)


async def test_non_stream_disconnect_cancels_decode(cluster: Cluster) -> None:
    cluster.script_text(hang_decode=True)
    task = asyncio.create_task(cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40}))
    await asyncio.wait_for(cluster.fakes.hanging.wait(), 5.0)
    task.cancel()
    await asyncio.wait_for(cluster.fakes.decode_cancelled.wait(), CANCEL_WAIT_S)


LONG = list(range(100, 170))  # 70 token ids


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        ("/v1/completions", {"prompt": ""}, 400, "prompt is empty", "prompt"),
        ("/v1/completions", {"prompt": LONG}, 400, "prompt has 70 tokens but the context is 64", "prompt"),
        ("/v1/completions", {"prompt": LONG[:60], "max_tokens": 10}, 400,
         "prompt has 60 tokens and max_tokens is 10: 70 tokens exceed the context of 64", "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be >= 1, got 0", "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be in [0, 2], got -1.0",
         "temperature"),
        ("/v1/completions", {"prompt": "x", "max_token": 2, "temprature": 0}, 400,
         "unrecognized request arguments: max_token, temprature", "max_token"),
        ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, 400,
         "best_of must be in [n, 64] (n is 2), got 1", "best_of"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {
            "type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integr"}}}}, 400,
         "response_format.json_schema.schema: the schema is invalid at type: 'integr' is not valid under any of "
         "the given schemas", "response_format.json_schema.schema"),
        ("/v1/completions", {"prompt": "x", "guided_choice": []}, 400,
         "guided_choice: choices must be a non-empty list of strings", "guided_choice"),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"json": "{"}}, 400,
         "structured_outputs.json: the schema is not valid JSON: Expecting property name enclosed in double quotes: "
         "line 1 column 2 (char 1)", "structured_outputs.json"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, 'stream: Input should be a valid boolean, got "yes"',
         "stream"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1}, 400,
         "prompt_logprobs is not supported: use echo with logprobs on /v1/completions", "prompt_logprobs"),
        ("/v1/completions", {"prompt": 42}, 400,
         "prompt: expected one of str, list[int], list[str], list[list[int]], got 42", "prompt"),
        ("/v1/completions", {"prompt": "hi \ud800"}, 400,
         "prompt is not valid Unicode: lone surrogate U+D800 at character 3", "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
         "messages.0.content is not valid Unicode: lone surrogate U+D800 at character 3", "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]}, 400,
         'messages.0.role must be one of "system", "user", "assistant", "developer", "tool", got "bot"',
         "messages.0.role"),
        ("/v1/completions", {"prompt": "x", "top_p": 2}, 400, "top_p must be in (0, 1], got 2.0", "top_p"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be in [1, 64], got 0", "n"),
        ("/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty must be in [-2, 2], got 3.0",
         "presence_penalty"),
        ("/v1/completions", {"prompt": "x", "logprobs": 30}, 400, "logprobs must be in [0, 20], got 30", "logprobs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
         "top_logprobs requires logprobs to be true", "top_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400,
         'max_tokens: Input should be a valid integer, got "ten"', "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400,
         'max_tokens: Input should be a valid integer, got "5"', "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}, 400,
         'temperature: Input should be a valid number, got "0.5"', "temperature"),
        ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, 400, "ignore_eos: Input should be a valid boolean, got 1",
         "ignore_eos"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt: Field required", "prompt"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages must not be empty", "messages"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404,
         f'model "gpt-4" does not exist; this cluster serves "{DEFAULT_MODEL}"', "model"),
    ],
)
async def test_bad_request_then_good_one(cluster: Cluster, path, body, status, message, param) -> None:
    # json.dumps escapes a lone surrogate as \\ud800, as a JSON client sends it (httpx's json= cannot).
    response = await cluster.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["message"], error["param"], error["type"]) == (message, param, "invalid_request_error")
    await assert_serves(cluster)


async def assert_serves(cluster: Cluster) -> None:
    cluster.script_text("ok")
    response = await cluster.http.post("/v1/completions", json={"prompt": "x"})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == "ok"


async def test_huge_prompt_is_refused_without_stalling_a_concurrent_request(cluster: Cluster) -> None:
    cluster.script_text("ok")
    huge = {"prompt": "lorem ipsum dolor sit amet " * 200000}  # 5.4 M characters, ~1.2 M tokens
    refused, served, health = await asyncio.gather(
        cluster.http.post("/v1/completions", json=huge),
        cluster.http.post("/v1/completions", json={"prompt": "x"}),
        cluster.http.get("/health"),
    )
    assert refused.status_code == 400
    assert refused.json()["error"]["message"] == (
        "prompt has 5400000 characters, so at least 66667 tokens (a token covers at most 81 characters), "
        f"but the context is {MAX_MODEL_LEN}")
    assert (served.status_code, served.json()["choices"][0]["text"]) == (200, "ok")
    assert (health.status_code, health.json()["workers"]) == (200, {"prefill": 1, "decode": 1, "pool": 1})


async def test_chat_without_max_tokens_may_use_the_rest_of_the_context(cluster: Cluster) -> None:
    cluster.script_text("Hi")
    response = await cluster.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 200, response.text
    sent = cluster.fakes.prefill_requests[-1]
    assert sent.sampling_params.max_tokens == MAX_MODEL_LEN - len(sent.prompt_token_ids)
    await cluster.http.post("/v1/completions", json={"prompt": "hi"})
    assert cluster.fakes.prefill_requests[-1].sampling_params.max_tokens == 16  # completions: OpenAI's legacy 16


@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "message"),
    [
        ("POST", "/v1/completions", {"content": b'{"prompt": "x"}',
                                     "headers": {"content-type": "application/x-www-form-urlencoded"}},
         400, "the request body must be a JSON object (send it with Content-Type: application/json)"),
        ("POST", "/v1/completions", {"content": b'["x"]', "headers": {"content-type": "application/json"}},
         400, "the request body must be a JSON object"),
        ("POST", "/v1/completions", {"content": b'{"prompt": "\xff"}', "headers": {"content-type": "application/json"}},
         400, "the request body is not valid UTF-8 (byte 0xff at offset 12)"),
        ("POST", "/v1/nope", {"json": {}}, 404,
         "no such endpoint: POST /v1/nope; this server serves /v1/completions, /v1/chat/completions, /v1/models, "
         "/tokenize, /detokenize, /version, /ping, /health, /metrics"),
        ("GET", "/v1/completions", {}, 405, "method not allowed: GET /v1/completions"),
        ("POST", "/v1/completions", {"content": b"x" * (16 * 1024 * 1024 + 1),
                                     "headers": {"content-type": "application/json"}},
         413, "the request body is over the limit of 16777216 bytes"),
    ],
)
async def test_http_errors_use_the_openai_format(cluster: Cluster, method, path, kwargs, status, message) -> None:
    response = await cluster.http.request(method, path, **kwargs)
    assert response.status_code == status
    assert response.json()["error"]["message"] == message
    assert response.json()["error"]["type"] == "invalid_request_error"
    await assert_serves(cluster)


async def test_chunked_body_over_the_limit_is_413(cluster: Cluster) -> None:
    async def chunks():  # no Content-Length: the router counts the bytes as they arrive
        for _ in range(17):
            yield b" " * (1024 * 1024)

    response = await cluster.http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["message"] == "the request body is over the limit of 16777216 bytes"
    await assert_serves(cluster)


async def test_openai_client_with_vllm_extras(cluster: Cluster) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http_port}/v1", api_key="unused")
    cluster.script_text("Hi there!")
    extras = {"top_k": 5, "min_tokens": 1, "repetition_penalty": 1.1, "ignore_eos": False, "stop_token_ids": [7]}
    reply = await client.chat.completions.create(
        model=DEFAULT_MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=20, temperature=0,
        top_p=0.9, seed=3, user="someone", extra_body=extras)
    assert reply.choices[0].message.content == "Hi there!"
    params = cluster.fakes.prefill_requests[-1].sampling_params
    assert (params.top_k, params.min_tokens, list(params.stop_token_ids)) == (5, 1, [7])
    assert params.repetition_penalty == pytest.approx(1.1)
    cluster.script_text("ok")
    stream = await client.completions.create(model=DEFAULT_MODEL, prompt="x", max_tokens=5, stream=True,
                                             stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "ok"
    with pytest.raises(openai.BadRequestError) as info:
        await client.completions.create(model=DEFAULT_MODEL, prompt="x", extra_body={"temprature": 0})
    assert info.value.body["message"] == "unrecognized request argument: temprature"
    await client.close()


async def test_bench_cli_takes_a_v1_url_and_fails_when_every_request_fails(cluster: Cluster, tmp_path,
                                                                              monkeypatch) -> None:
    from click.testing import CliRunner

    import bench.cli

    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "no-data"))  # a data folder without the ShareGPT set
    cluster.script_text("ok")
    args = ["--url", f"http://127.0.0.1:{cluster.router.http_port}/v1", "--num-requests", "2", "--concurrency", "1",
            "--max-tokens", "4", "--no-progress", "--roofline-model", "", "--output-dir", str(tmp_path / "out")]
    # bench runs its own event loop: on a thread, while this loop serves the router
    wrong = await asyncio.to_thread(CliRunner().invoke, bench.cli.bench, [*args, "--model", "foo"])
    assert wrong.exit_code == 1
    assert wrong.output.splitlines()[-1] == (
        f'Error: all 2 requests failed; the first (http_404): model "foo" does not exist; this cluster serves '
        f'"{DEFAULT_MODEL}" (records in {tmp_path / "out" / "run.json"})')
    good = await asyncio.to_thread(CliRunner().invoke, bench.cli.bench, args)
    assert good.exit_code == 0, good.output
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    assert (run["summary"]["num_ok"], run["settings"]["url"]) == (2, f"http://127.0.0.1:{cluster.router.http_port}")
    assert (run["label"], run["settings"]["workload"], run["settings"]["path"]) == (
        "built-in prompts concurrency", "built-in prompts", "built-in prompts")
    swept = await asyncio.to_thread(CliRunner().invoke, bench.cli.bench, [*args, "--rates", "4"])
    assert swept.exit_code == 0, swept.output
    sweep = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert (sweep["label"], [p["rate_per_s"] for p in sweep["sweep"]]) == ("built-in prompts poisson rate sweep", [4.0])
    assert (tmp_path / "out" / "rate_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


async def test_malformed_json_is_400(cluster: Cluster) -> None:
    response = await cluster.http.post(
        "/v1/completions", content=b'{"prompt": "x",', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("malformed JSON body: ")
    await assert_serves(cluster)


@pytest.mark.parametrize(
    ("code", "status", "error_type", "message"),
    [
        # The request's own fault: the worker's message alone (the router logs which worker).
        (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error", "fake prefill refuses (INVALID_ARGUMENT)"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error",
         "prefill worker failed (RESOURCE_EXHAUSTED): fake prefill refuses (RESOURCE_EXHAUSTED)"),
    ],
)
async def test_prefill_worker_errors_map_to_status(cluster: Cluster, code, status, error_type, message) -> None:
    cluster.script_text(prefill_error=code)
    response = await cluster.http.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert response.status_code == status
    error = response.json()["error"]
    assert error["type"] == error_type
    assert error["message"] == message
    cluster.assert_not_released(cluster.fakes.prefill_requests[-1].request_id)  # broadcast to the pools
    await assert_serves(cluster)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
async def test_failed_prefill_worker_is_marked_down_and_the_decode_worker_prefills(cluster: Cluster, code) -> None:
    cluster.script_text(prefill_error=code)
    try:
        response = await cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40})
        assert response.status_code == 200, response.text
        # The only prefill worker failed: colocated (this fake decode worker sends the tokens
        # after the scripted first one, as in disaggregated mode).
        assert response.json()["choices"][0]["text"] == cluster.tokenizer.decode(cluster.tokenizer.encode(TEXT)[1:])
        decode = cluster.fakes.decode_requests[-1]
        assert not decode.HasField("first_token_id") and not decode.HasField("manifest")
        assert cluster.router.view.workers("prefill") == []
        cluster.assert_not_released(cluster.fakes.prefill_requests[-1].request_id)
    finally:
        await cluster.register()  # a newer heartbeat and a SERVING health check bring it back
    assert [w.address for w in cluster.router.view.workers("prefill")] == [cluster.address("prefill")]
    await assert_serves(cluster)


async def test_decode_error_mid_stream_with_no_other_decode_worker_aborts(cluster: Cluster) -> None:
    cluster.script_text(finish_token=None, decode_error=grpc.StatusCode.UNAVAILABLE)  # breaks before the end
    try:
        async with cluster.http.stream("POST", "/v1/completions",
                                       json={"prompt": "x", "max_tokens": 40, "stream": True}) as r:
            assert r.status_code == 200
            events = await sse_events(r)
    finally:
        await cluster.register()
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    assert events[-2]["error"]["message"] == (
        "decode worker failed (UNAVAILABLE): fake decode broke; no other decode worker to resume on")
    assert events[-1] == "[DONE]"
    await assert_serves(cluster)


async def test_stream_broken_after_its_last_token_still_finishes(cluster: Cluster) -> None:
    cluster.script_text(decode_error=grpc.StatusCode.UNAVAILABLE)  # EOS arrived, then the stream broke
    try:
        response = await cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40})
    finally:
        await cluster.register()
    assert response.status_code == 200
    assert (response.json()["choices"][0]["text"], response.json()["choices"][0]["finish_reason"]) == (TEXT, "stop")


async def test_client_request_id_is_echoed_and_never_reused_inside(cluster: Cluster) -> None:
    cluster.script_text()
    num_prefills = len(cluster.fakes.prefill_requests)
    replies = await asyncio.gather(*(cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40},
                                                       headers={"x-request-id": "dup-1"}) for _ in range(2)))
    for reply in replies:
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "dup-1"
        assert reply.json()["choices"][0]["text"] == TEXT
    ids = [p.request_id for p in cluster.fakes.prefill_requests[num_prefills:]]
    assert len(set(ids)) == 2 and all(re.fullmatch("dup-1-[0-9a-f]{12}", i) for i in ids)
    bad = await cluster.http.post("/v1/completions", json={"prompt": "x"}, headers={"x-request-id": "a b"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-request-id"


async def test_no_workers_is_503_and_health_says_why(cluster: Cluster) -> None:
    assert (await cluster.http.get("/health")).status_code == 200
    await cluster.deregister(("prefill", "decode"))
    try:
        response = await cluster.http.post("/v1/completions", json={"prompt": "x"})
        assert (response.status_code, response.headers["retry-after"]) == (503, "5")
        assert response.json()["error"]["message"] == "no healthy decode worker is registered"
        health = await cluster.http.get("/health")
        assert health.status_code == 503
        assert health.json()["reason"] == "no decode worker is registered"
    finally:
        await cluster.register()
    await assert_serves(cluster)


async def test_models_and_metrics(cluster: Cluster) -> None:
    models = (await cluster.http.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == [DEFAULT_MODEL]
    await assert_serves(cluster)
    text = (await cluster.http.get("/metrics")).text
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", 'vllm:request_success_total{finished_reason="stop",model_name=',
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", 'tandem:rejections_total{reason="invalid_request"}',
                 "tandem:router_requests_running 0.0"):
        assert name in text, name


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def grpc_stub(cluster: Cluster):
    channel = aio_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    yield router_pb2_grpc.RouterStub(channel), health_pb2_grpc.HealthStub(channel)
    await channel.close()


async def test_grpc_generate(cluster: Cluster, grpc_stub) -> None:
    stub, health = grpc_stub
    status = await health.Check(health_pb2.HealthCheckRequest(service="tandem.v1.Router"))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    cluster.script_text()
    request = router_pb2.GenerateRequest(text="Say hello", request_id="grpc-1",
                                         sampling_params=common_pb2.SamplingParams(max_tokens=40))
    responses = [r async for r in stub.Generate(request)]
    assert "".join(r.delta.text for r in responses[:-1]) == TEXT
    finished = responses[-1].finished
    assert (finished.finish_reason, finished.request_id) == (common_pb2.FINISH_REASON_STOP, "grpc-1")
    assert finished.usage.completion_tokens == len(cluster.tokenizer.encode(TEXT)) + 1
    assert finished.usage.cached_tokens == 16
    assert cluster.fakes.prefill_requests[-1].sampling_params.temperature == 0.0  # absent means greedy
    cluster.assert_not_released("grpc-1")


@pytest.mark.parametrize(
    ("request_kwargs", "code", "message"),
    [
        ({"text": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        ({"text": "x", "sampling_params": common_pb2.SamplingParams(top_p=0)}, grpc.StatusCode.INVALID_ARGUMENT,
         "top_p must be in (0, 1], got 0.0"),
        ({"text": "x", "model": "nope"}, grpc.StatusCode.NOT_FOUND,
         f'model "nope" does not exist; this cluster serves "{DEFAULT_MODEL}"'),
    ],
)
async def test_grpc_bad_request(cluster: Cluster, grpc_stub, request_kwargs, code, message) -> None:
    stub, _ = grpc_stub
    with pytest.raises(grpc.aio.AioRpcError) as info:
        [r async for r in stub.Generate(router_pb2.GenerateRequest(**request_kwargs))]
    assert (info.value.code(), info.value.details()) == (code, message)


async def test_grpc_no_workers_is_unavailable(cluster: Cluster, grpc_stub) -> None:
    stub, _ = grpc_stub
    await cluster.deregister(("decode",))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(router_pb2.GenerateRequest(text="x", sampling_params=common_pb2.SamplingParams(max_tokens=1)))]
        assert (info.value.code(), info.value.details()) == (grpc.StatusCode.UNAVAILABLE, "no healthy decode worker is registered")
        assert dict(info.value.trailing_metadata())["retry-after"] == "5"
    finally:
        await cluster.register()


async def test_without_prefill_workers_the_decode_worker_runs_colocated(cluster: Cluster) -> None:
    cluster.script_text("Hello world", num_cached_tokens=48)
    num_prefills = len(cluster.fakes.prefill_requests)
    await cluster.deregister(("prefill",))
    try:
        health = await cluster.http.get("/health")
        # It had prefill workers: running colocated now is a fall-back, and says so (router.placement.fallback).
        assert (health.status_code, health.json()["mode"]) == (200, "colocated_fallback")
        before = health.json()["colocated_fallbacks"].get("no_prefill_worker", 0)
        response = await cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})
        assert response.status_code == 200
        # The decode worker's count, from its first chunk (the prefill worker's 16 never came).
        assert response.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
        decode = cluster.fakes.decode_requests[-1]
        assert not decode.HasField("first_token_id") and not decode.HasField("manifest")
        assert len(cluster.fakes.prefill_requests) == num_prefills
        after = (await cluster.http.get("/health")).json()["colocated_fallbacks"]["no_prefill_worker"]
        assert after == before + 1
    finally:
        await cluster.register()


async def test_grpc_cancel_cancels_decode(cluster: Cluster, grpc_stub) -> None:
    stub, _ = grpc_stub
    cluster.script_text(hang_decode=True)
    call = stub.Generate(router_pb2.GenerateRequest(text="x", request_id="grpc-cancel",
                                                    sampling_params=common_pb2.SamplingParams(max_tokens=40)))
    first = await call.read()
    assert first.delta.token_ids == [cluster.fakes.script.first_token_id]
    await asyncio.wait_for(cluster.fakes.hanging.wait(), 5.0)
    call.cancel()
    await asyncio.wait_for(cluster.fakes.decode_cancelled.wait(), CANCEL_WAIT_S)
    cluster.assert_not_released("grpc-cancel")


async def test_grpc_decode_error_mid_stream(cluster: Cluster, grpc_stub) -> None:
    stub, _ = grpc_stub
    cluster.script_text(finish_token=None, decode_error=grpc.StatusCode.UNAVAILABLE)
    call = stub.Generate(router_pb2.GenerateRequest(text="x", sampling_params=common_pb2.SamplingParams(max_tokens=40)))
    deltas = []
    try:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for response in call:
                deltas.append(response.delta.text)
    finally:
        await cluster.register()
    assert "".join(deltas) == TEXT
    assert (info.value.code(), info.value.details()) == (
        grpc.StatusCode.UNAVAILABLE, "decode worker failed (UNAVAILABLE): fake decode broke; no other decode worker to resume on")


def expected_logprobs(cluster: Cluster, text: str = TEXT) -> list[float]:
    """What the fakes send for ``text`` then EOS: -(p + 1) / 10 at position p (float32 on the wire)."""
    num_tokens = len(cluster.tokenizer.encode(text)) + 1
    return [pytest.approx(-(p + 1) / 10, abs=1e-6) for p in range(num_tokens)]


async def test_completion_logprobs_and_sampling_extras_reach_the_workers(cluster: Cluster) -> None:
    cluster.script_text()
    body = {"prompt": "x", "max_tokens": 40, "logprobs": 2, "min_tokens": 3, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.25}
    response = await cluster.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    logprobs = response.json()["choices"][0]["logprobs"]
    ids = cluster.tokenizer.encode(TEXT) + [EOS]
    assert logprobs["tokens"] == [cluster.tokenizer.token_text(t) for t in ids]
    assert logprobs["token_logprobs"] == expected_logprobs(cluster)
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    # The top dict: the two best (the token itself first in the fakes), best value first.
    assert list(logprobs["top_logprobs"][0].values()) == [pytest.approx(-0.1), pytest.approx(-1.1)]
    for sent in (cluster.fakes.prefill_requests[-1], cluster.fakes.decode_requests[-1]):
        params = sent.sampling_params
        assert (params.logprobs, params.min_tokens, params.presence_penalty) == (2, 3, 0.5)
        assert (params.frequency_penalty, params.repetition_penalty) == (-0.5, 1.25)


async def test_chat_stream_logprobs_follow_the_tokens(cluster: Cluster) -> None:
    cluster.script_text()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "stream": True, "logprobs": True,
            "top_logprobs": 1}
    async with cluster.http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1]]
    content = [entry for c in choices if c["logprobs"] for entry in c["logprobs"]["content"]]
    assert [entry["logprob"] for entry in content] == expected_logprobs(cluster)
    assert all([top["token"] for top in entry["top_logprobs"]] == [entry["token"]] for entry in content)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == TEXT
    assert events[-2]["choices"][0]["logprobs"] is None  # the finish chunk carries no tokens


async def test_no_logprobs_unless_asked(cluster: Cluster) -> None:
    cluster.script_text()
    data = (await cluster.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40})).json()
    assert data["choices"][0]["logprobs"] is None
    assert not cluster.fakes.prefill_requests[-1].sampling_params.HasField("logprobs")


async def test_n_choices_fan_out_with_offset_seeds_and_summed_usage(cluster: Cluster) -> None:
    cluster.script_text("Hi there")
    num_prefills = len(cluster.fakes.prefill_requests)
    body = {"prompt": "Say hi", "max_tokens": 20, "n": 3, "seed": 41, "temperature": 0.7}
    data = (await cluster.http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert {c["text"] for c in data["choices"]} == {"Hi there"}
    prefills = cluster.fakes.prefill_requests[num_prefills:]
    # Choice 0 prefills first, the others after it; each attempt's id is <id>-<choice>-<12 hex>.
    assert re.fullmatch(rf"{data['id']}-0-[0-9a-f]{{12}}", prefills[0].request_id)
    assert sorted(p.request_id.rsplit("-", 1)[0] for p in prefills) == [f"{data['id']}-{i}" for i in range(3)]
    assert sorted(p.sampling_params.seed for p in prefills) == [41, 42, 43]
    num_generated = len(cluster.tokenizer.encode("Hi there")) + 1
    assert data["usage"]["completion_tokens"] == 3 * num_generated
    assert data["usage"]["prompt_tokens"] == len(cluster.tokenizer.encode("Say hi"))
    for i in range(3):
        cluster.assert_not_released(f"{data['id']}-{i}")


async def test_n_choices_stream_with_their_index(cluster: Cluster) -> None:
    cluster.script_text()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 30, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    async with cluster.http.stream("POST", "/v1/chat/completions", json=body) as response:
        events = await sse_events(response)
    chunks, usage_chunk = events[:-2], events[-2]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(c["delta"].get("content", "") for c in mine) == TEXT
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert usage_chunk["usage"]["completion_tokens"] == 2 * (len(cluster.tokenizer.encode(TEXT)) + 1)


async def test_grpc_n_and_logprobs(cluster: Cluster, grpc_stub) -> None:
    stub, _ = grpc_stub
    cluster.script_text()
    params = common_pb2.SamplingParams(max_tokens=40, logprobs=0, seed=5, temperature=1.0)
    request = router_pb2.GenerateRequest(text="x", request_id="grpc-n", n=2, sampling_params=params)
    responses = [r async for r in stub.Generate(request)]
    for index in (0, 1):
        deltas = [r.delta for r in responses if r.WhichOneof("event") == "delta" and r.delta.index == index]
        assert "".join(d.text for d in deltas) == TEXT
        assert [lp.logprob for d in deltas for lp in d.logprobs] == expected_logprobs(cluster)
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
    finished = [r.finished for r in responses if r.WhichOneof("event") == "finished"]
    assert sorted(f.index for f in finished) == [0, 1]
    assert {f.request_id for f in finished} == {"grpc-n"}
    cluster.assert_not_released("grpc-n-0")
    cluster.assert_not_released("grpc-n-1")
