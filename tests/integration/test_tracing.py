"""Tracing: one disaggregated request, sent with a client's W3C traceparent, is one trace:
router HTTP span → prefill RPC (→ its pool call) and decode RPC,
every span in the client's trace, parents as the calls nest, joined by the request id.
In-memory exporter; fake workers (tests.integration.test_router) on real GrpcServices."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from core import grpc_auth, tracing
from core.grpc_auth import ClusterSecurity
from core.grpc_service import GrpcService, cluster_aio_channel
from core.model_source import DEFAULT_MODEL, resolve_model
from core.registry import WorkerInfo, WorkerRegistry
from router.config import RouterConfig
from router.server import RouterServer
from router.tokenizer import load_tokenizer
from tandem.v1 import decode_worker_pb2_grpc, kv_pool_pb2, kv_pool_pb2_grpc, prefill_worker_pb2_grpc
from tests.integration.test_router import EOS, TEXT, FakeDecode, FakePool, FakePrefill, Fakes, Script

pytestmark = pytest.mark.asyncio(loop_scope="module")
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


class PoolWithLocate(FakePool):
    async def LocateBlocks(self, request, context):
        return kv_pool_pb2.LocateBlocksResponse()


class PrefillThatAsksThePool(FakePrefill):
    """As a real prefill worker does, asks the pool for the prompt's cached prefix first."""

    async def Prefill(self, request, context):
        async with cluster_aio_channel(self.fakes.pool_address) as channel:
            await kv_pool_pb2_grpc.KVPoolStub(channel).LocateBlocks(
                kv_pool_pb2.LocateBlocksRequest(request_id=request.request_id), timeout=10)
        return await super().Prefill(request, context)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def traced(redis_url: str):
    exporter = InMemorySpanExporter()
    assert tracing.configure("tandem-test", exporter=exporter)
    url = redis_url.rsplit("/", 1)[0] + "/9"
    fakes = Fakes()
    services = {role: GrpcService("127.0.0.1", 0, [name], grace_s=0, security=ClusterSecurity()) for role, name in
                (("prefill", "tandem.v1.PrefillWorker"), ("decode", "tandem.v1.DecodeWorker"), ("pool", "tandem.v1.KVPool"))}
    prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillThatAsksThePool(fakes), services["prefill"].server)
    decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(FakeDecode(fakes), services["decode"].server)
    kv_pool_pb2_grpc.add_KVPoolServicer_to_server(PoolWithLocate(fakes), services["pool"].server)
    addresses = {role: f"127.0.0.1:{await service.start()}" for role, service in services.items()}
    fakes.pool_address = addresses["pool"]
    tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
    router = RouterServer(RouterConfig(http_port=0, grpc_port=0, redis_url=url, max_model_len=64, shutdown_grace_s=0.0,
                                       disaggregation="always"), tokenizer=tokenizer)
    await router.start()
    registry = WorkerRegistry(url)
    for role, address in addresses.items():
        await registry.heartbeat(WorkerInfo(f"fake-{role}", role, address), ttl_s=600)
    await router.view.refresh()
    yield router, fakes, tokenizer, exporter
    await router.stop()
    await registry.redis.flushdb()
    await registry.close()
    for service in services.values():
        await service.stop()
    tracing.reset()


async def test_one_disaggregated_request_is_one_trace(traced) -> None:
    router, fakes, tokenizer, exporter = traced
    ids = tokenizer.encode(TEXT) + [EOS]
    fakes.reset(Script(first_token_id=ids[0], decode_chunks=[ids[1:]]))
    exporter.clear()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=10) as http:
        response = await http.post("/v1/completions", headers={"traceparent": f"00-{TRACE_ID}-{CLIENT_SPAN_ID}-01"},
                                   json={"model": DEFAULT_MODEL, "prompt": "Say hello", "max_tokens": 40})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == TEXT
    request_id = response.headers["x-request-id"]

    # No pool release from the router: the workers' KV connectors own it (engine/kv_connector).
    expected = {"POST /v1/completions", "tandem.v1.PrefillWorker/Prefill", "tandem.v1.KVPool/LocateBlocks",
                "tandem.v1.DecodeWorker/Decode"}

    async def all_ended() -> list:
        while True:  # polled (deadline below): a server span may end just after the client's answer
            spans = [s for s in exporter.get_finished_spans() if f"{s.context.trace_id:032x}" == TRACE_ID]
            if {s.name for s in spans} >= expected:
                return spans
            await asyncio.sleep(0.02)

    spans = await asyncio.wait_for(all_ended(), timeout=10)
    assert sorted(s.name for s in spans) == sorted(expected)  # one span each, all in the client's trace
    by_name = {s.name: s for s in spans}
    root = by_name["POST /v1/completions"]
    assert f"{root.parent.span_id:016x}" == CLIENT_SPAN_ID and root.parent.is_remote
    for child in ("tandem.v1.PrefillWorker/Prefill", "tandem.v1.DecodeWorker/Decode"):
        assert by_name[child].parent.span_id == root.context.span_id, child
    assert by_name["tandem.v1.KVPool/LocateBlocks"].parent.span_id == by_name["tandem.v1.PrefillWorker/Prefill"].context.span_id
    assert root.attributes["tandem.request_id"] == request_id
    assert root.attributes["http.response.status_code"] == 200
    for name in ("tandem.v1.PrefillWorker/Prefill", "tandem.v1.DecodeWorker/Decode"):
        assert by_name[name].attributes["tandem.request_id"].startswith(request_id + "-"), name
    assert by_name["tandem.v1.DecodeWorker/Decode"].attributes["tandem.server"] == "tandem.v1.DecodeWorker"


async def test_without_a_client_traceparent_the_router_starts_the_trace(traced) -> None:
    router, fakes, tokenizer, exporter = traced
    ids = tokenizer.encode(TEXT) + [EOS]
    fakes.reset(Script(first_token_id=ids[0], decode_chunks=[ids[1:]]))
    exporter.clear()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=10) as http:
        response = await http.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "Say hello", "max_tokens": 40})
    assert response.status_code == 200
    [root] = [s for s in exporter.get_finished_spans() if s.name == "POST /v1/completions"]
    assert root.parent is None
    prefill = [s for s in exporter.get_finished_spans() if s.name == "tandem.v1.PrefillWorker/Prefill"]
    assert [s.context.trace_id for s in prefill] == [root.context.trace_id]

