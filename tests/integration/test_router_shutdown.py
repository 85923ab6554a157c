"""RouterServer.stop() with requests in flight (router.shutdown), against fake workers.

The fake decode worker sends its chunks, then parks until the test opens a gate (never, for
requests that must be ended by the router). Each test starts its own router and stops it.
Synchronisation is by events and polling with deadlines, never sleeps.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import httpx
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.grpc_service import aio_channel
from core.model_source import DEFAULT_MODEL, resolve_model
from core.registry import WorkerRegistry
from router.config import RouterConfig
from router.server import RouterServer
from router.tokenizer import load_tokenizer
from tandem.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.integration.test_router import EOS, Fakes, Script, sse_events, start_fake_workers

pytestmark = pytest.mark.asyncio(loop_scope="module")

GRACE_S = 1.0
WAIT_S = 10.0  # deadline of every wait below; far above what any step takes
TEXT = "One two three four five"
SHUTTING_DOWN = {"message": "router shutting down", "type": "service_unavailable_error", "param": None,
                 "code": "shutting_down"}


class GatedDecode(decode_worker_pb2_grpc.DecodeWorkerServicer):
    """Streams the script's first chunk, then waits for ``gate`` before the rest and Finished."""

    def __init__(self, fakes: Fakes):
        self.fakes = fakes
        self.gate = asyncio.Event()
        self.num_parked = 0
        self.parked = asyncio.Event()  # set each time a stream parks
        self.num_cancelled = 0

    async def Decode(self, request, context):
        script = self.fakes.script
        first, *rest = script.decode_chunks
        yield decode_worker_pb2.DecodeResponse(tokens=decode_worker_pb2.TokenChunk(token_ids=first))
        self.num_parked += 1
        self.parked.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.num_cancelled += 1
            raise
        for chunk in rest:
            yield decode_worker_pb2.DecodeResponse(tokens=decode_worker_pb2.TokenChunk(token_ids=chunk))
        num_output_tokens = 1 + sum(len(c) for c in script.decode_chunks)
        finished = decode_worker_pb2.Finished(finish_reason=script.finish_reason, num_output_tokens=num_output_tokens)
        yield decode_worker_pb2.DecodeResponse(finished=finished)

    async def wait_parked(self, count: int) -> None:
        async def parked() -> None:
            while self.num_parked < count:
                self.parked.clear()
                await self.parked.wait()

        await asyncio.wait_for(parked(), WAIT_S)


@dataclass
class Workers:
    fakes: Fakes
    decode: GatedDecode
    tokenizer: object
    redis_url: str


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def workers(redis_url: str):
    url = redis_url.rsplit("/", 1)[0] + "/4"  # a db of our own in the shared server
    fakes = Fakes()
    decode = GatedDecode(fakes)
    server, infos = await start_fake_workers(fakes, decode)
    registry = WorkerRegistry(url)
    for info in infos:
        await registry.heartbeat(info, ttl_s=600)
    tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
    yield Workers(fakes, decode, tokenizer, url)
    await registry.redis.flushdb()
    await registry.close()
    decode.gate.set()
    await server.stop(0)


@pytest_asyncio.fixture(loop_scope="module")
async def router(workers: Workers):
    """A started router; the test stops it (stopping twice is never needed)."""
    ids = workers.tokenizer.encode(TEXT) + [EOS]
    workers.fakes.reset(Script(first_token_id=ids[0], decode_chunks=[ids[1:3], ids[3:]]))  # parks after ids[1:3]
    workers.decode.gate.clear()
    workers.decode.num_parked = workers.decode.num_cancelled = 0
    config = RouterConfig(http_port=0, grpc_port=0, redis_url=workers.redis_url, max_model_len=64,
                          shutdown_grace_s=GRACE_S)
    server = RouterServer(config, tokenizer=workers.tokenizer)
    await server.start()
    await server.view.refresh()
    yield server


async def wait_refusing(http: httpx.AsyncClient) -> None:
    """Polls /health until the stopping router answers 503 (stop() has begun)."""
    async def refusing() -> None:
        while (await http.get("/health")).status_code != 503:
            await asyncio.sleep(0.01)  # polling interval, not synchronisation

    await asyncio.wait_for(refusing(), WAIT_S)


async def read_stream(http: httpx.AsyncClient, body: dict) -> list:
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        return await sse_events(response)


async def test_stop_ends_running_requests_with_a_last_event_and_refuses_new_ones(router, workers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    channel = aio_channel(f"127.0.0.1:{router.grpc_port}")
    stub = router_pb2_grpc.RouterStub(channel)
    grpc_request = router_pb2.GenerateRequest(text="x", sampling_params=common_pb2.SamplingParams(max_tokens=40))
    async with channel, httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=WAIT_S) as http:
        stream = asyncio.create_task(read_stream(http, {"prompt": "x", "max_tokens": 40, "stream": True}))
        whole = asyncio.create_task(http.post("/v1/completions", json={"prompt": "x", "max_tokens": 40}))
        grpc_call = stub.Generate(grpc_request)
        first_grpc = await asyncio.wait_for(grpc_call.read(), WAIT_S)
        await workers.decode.wait_parked(3)
        stopping = asyncio.create_task(router.stop())
        await wait_refusing(http)
        health_body = (await http.get("/health")).json()
        grpc_health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Router"))
        refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "stream": True})
        with pytest.raises(grpc.aio.AioRpcError) as refused_grpc:
            [r async for r in stub.Generate(grpc_request)]
        events = await asyncio.wait_for(stream, WAIT_S)
        response = await asyncio.wait_for(whole, WAIT_S)
        with pytest.raises(grpc.aio.AioRpcError) as ended_grpc:
            while await grpc_call.read() is not grpc.aio.EOF:
                pass
        await asyncio.wait_for(stopping, WAIT_S)
    assert health_body["status"] == "shutting_down"
    assert grpc_health.status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert (refused.status_code, refused.json()) == (503, {"error": SHUTTING_DOWN})
    assert (refused_grpc.value.code(), refused_grpc.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                                         "router shutting down")
    # The stream: its tokens so far, then an abort chunk, the error and [DONE].
    script = workers.fakes.script
    sent = workers.tokenizer.decode([script.first_token_id, *script.decode_chunks[0]])
    assert sent == "One two three"
    assert "".join(e["choices"][0]["text"] for e in events[:-3]) == sent
    assert events[-3]["choices"][0]["finish_reason"] == "abort"
    assert events[-2] == {"error": SHUTTING_DOWN}
    assert events[-1] == "[DONE]"
    assert (response.status_code, response.json()) == (503, {"error": SHUTTING_DOWN})
    assert first_grpc.delta.token_ids == [workers.fakes.script.first_token_id]
    assert (ended_grpc.value.code(), ended_grpc.value.details()) == (grpc.StatusCode.UNAVAILABLE,
                                                                     "router shutting down")
    assert workers.decode.num_cancelled == 3  # the router cancelled every parked decode stream
    assert router.generation.shutdown.num_running == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert any("ending 3 request(s) still running after the 1 s grace period" in r.getMessage()
               for r in caplog.records)


async def test_requests_that_finish_within_the_grace_period_finish_normally(router, workers, caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=WAIT_S) as http:
        stream = asyncio.create_task(read_stream(http, {"prompt": "x", "max_tokens": 40, "stream": True}))
        await workers.decode.wait_parked(1)
        stopping = asyncio.create_task(router.stop())
        await wait_refusing(http)
        workers.decode.gate.set()  # the decode worker finishes inside the grace period
        events = await asyncio.wait_for(stream, WAIT_S)
        await asyncio.wait_for(stopping, WAIT_S)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == TEXT
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1])
    assert workers.decode.num_cancelled == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and r.name.startswith(("router", "uvicorn"))] == []


async def test_stop_returns_when_a_server_never_stops(router, caplog, monkeypatch) -> None:
    """An HTTP server whose shutdown never ends and a gRPC server whose stop never completes (a
    connection or call they keep waiting for) do not hang the router's stop: each is left
    ``STOP_MARGIN_S`` after its own grace period, with a warning naming it."""
    monkeypatch.setattr("router.server.STOP_MARGIN_S", 0.2)
    monkeypatch.setattr("core.grpc_service.STOP_MARGIN_S", 0.2)
    never = asyncio.Event()

    async def hang(*args, **kwargs) -> None:
        await never.wait()

    grpc_stop = router.grpc.server.stop
    monkeypatch.setattr(router.uvicorn, "shutdown", hang)
    monkeypatch.setattr(router.grpc.server, "stop", hang)
    with caplog.at_level(logging.WARNING):
        await asyncio.wait_for(router.stop(), WAIT_S)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"the HTTP server on port {router.http_port} had not stopped after 1.2 s: cancelled" in warnings
    assert f"the gRPC server on {router.grpc.address} had not stopped 0.2 s after its 1 s grace period: left behind" \
        in warnings
    assert router._http_task.cancelled()
    await grpc_stop(0)
    for server in router.uvicorn.servers:
        server.close()
