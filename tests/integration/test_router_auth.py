"""Access control end to end: a router with API keys in front of fake workers that demand the
cluster token. 401 / UNAUTHENTICATED without a key (and nothing reaches a worker), 200 with
one; /health and /metrics open unless configured closed; the router's worker RPCs carry the
token, and a caller without it is refused by the worker."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
import pytest_asyncio

from core import grpc_service
from core.grpc_auth import ClusterSecurity
from core.grpc_service import GrpcService, cluster_aio_channel
from core.model_source import DEFAULT_MODEL, resolve_model
from core.registry import WorkerInfo, WorkerRegistry
from router.config import RouterConfig
from router.server import RouterServer
from router.tokenizer import load_tokenizer
from tandem.v1 import (
    common_pb2,
    decode_worker_pb2_grpc,
    kv_pool_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)
from tests.integration.test_router import EOS, TEXT, FakeDecode, FakePool, FakePrefill, Fakes, Script

pytestmark = pytest.mark.asyncio(loop_scope="module")
KEYS = ("key-one", "key-two")
TOKEN = "cluster-s3cret"


class AuthCluster:
    def __init__(self, router: RouterServer, fakes: Fakes, tokenizer, worker_address: str):
        self.router, self.fakes, self.tokenizer, self.worker_address = router, fakes, tokenizer, worker_address
        self.base_url = f"http://127.0.0.1:{router.http_port}"

    def script(self) -> None:
        ids = self.tokenizer.encode(TEXT) + [EOS]
        self.fakes.reset(Script(first_token_id=ids[0], decode_chunks=[ids[1:]]))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def cluster(redis_url: str):
    url = redis_url.rsplit("/", 1)[0] + "/7"  # a db of our own in the shared server
    member = ClusterSecurity(token=TOKEN)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(grpc_service, "process_security", lambda: member)  # as TANDEM_CLUSTER_TOKEN would
        fakes = Fakes()
        workers_service = GrpcService("127.0.0.1", 0, ["tandem.v1.PrefillWorker"], grace_s=0, security=member)
        server = workers_service.server
        prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(FakePrefill(fakes), server)
        decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(FakeDecode(fakes), server)
        kv_pool_pb2_grpc.add_KVPoolServicer_to_server(FakePool(fakes), server)
        port = await workers_service.start()
        address = fakes.pool_address = f"127.0.0.1:{port}"
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
        config = RouterConfig(http_port=0, grpc_port=0, redis_url=url, max_model_len=64, shutdown_grace_s=1.0,
                              api_keys=KEYS)
        router = RouterServer(config, tokenizer=tokenizer)
        await router.start()
        registry = WorkerRegistry(url)
        for role in ("prefill", "decode", "pool"):
            await registry.heartbeat(WorkerInfo(f"fake-{role}", role, address), ttl_s=600)
        await router.view.refresh()
        yield AuthCluster(router, fakes, tokenizer, address)
        await router.stop()
        await registry.redis.flushdb()
        await registry.close()
        await workers_service.stop()


BODY = {"model": DEFAULT_MODEL, "prompt": "Say hello", "max_tokens": 40}


@pytest.mark.parametrize(("headers", "message"), [
    ({}, "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."),
    ({"authorization": "Bearer key-three"}, "Incorrect API key provided."),
    ({"authorization": "key-one"}, "Incorrect API key provided."),  # no Bearer scheme
])
async def test_http_without_a_valid_key_is_an_openai_401_and_reaches_no_worker(cluster, headers, message) -> None:
    before = len(cluster.fakes.prefill_requests)
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            response = await http.request(method, path, json=BODY, headers=headers)
            assert response.status_code == 401
            assert response.headers["www-authenticate"] == "Bearer"
            assert response.json() == {"error": {"message": message, "type": "invalid_request_error",
                                                 "param": None, "code": "invalid_api_key"}}
    assert len(cluster.fakes.prefill_requests) == before


async def test_http_with_any_configured_key_is_served_and_health_metrics_are_open(cluster) -> None:
    async with httpx.AsyncClient(base_url=cluster.base_url, timeout=10) as http:
        for key in KEYS:
            cluster.script()
            response = await http.post("/v1/completions", json=BODY, headers={"authorization": f"Bearer {key}"})
            assert response.status_code == 200
            assert response.json()["choices"][0]["text"] == TEXT
        assert (await http.get("/health")).status_code == 200
        metrics = await http.get("/metrics")
        assert metrics.status_code == 200 and "vllm:request_success_total" in metrics.text
    cluster.script()
    client = openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="key-two")
    reply = await client.completions.create(model=DEFAULT_MODEL, prompt="Say hello", max_tokens=40)
    assert reply.choices[0].text == TEXT
    with pytest.raises(openai.AuthenticationError):
        await openai.AsyncOpenAI(base_url=cluster.base_url + "/v1", api_key="wrong").models.list()


async def test_grpc_needs_a_key_too(cluster) -> None:
    request = router_pb2.GenerateRequest(text="Say hello", sampling_params=common_pb2.SamplingParams(max_tokens=40))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{cluster.router.grpc_port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [r async for r in stub.Generate(request)]
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        cluster.script()
        responses = [r async for r in stub.Generate(request, metadata=[("authorization", "Bearer key-one")])]
        assert "".join(r.delta.text for r in responses[:-1]) == TEXT
        assert responses[-1].finished.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_worker_refuses_a_caller_without_the_cluster_token(cluster) -> None:
    message = prefill_worker_pb2.PrefillRequest(request_id="outsider", prompt_token_ids=[1, 2, 3])
    before = len(cluster.fakes.prefill_requests)
    async with cluster_aio_channel(cluster.worker_address, ClusterSecurity()) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await prefill_worker_pb2_grpc.PrefillWorkerStub(channel).Prefill(message, timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(cluster.fakes.prefill_requests) == before  # the servicer never ran


async def test_open_paths_can_be_closed(redis_url: str) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/8"
    tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model(DEFAULT_MODEL))
    config = RouterConfig(http_port=0, grpc_port=0, redis_url=url, max_model_len=64, shutdown_grace_s=0.0,
                          api_keys=KEYS, open_paths=("/metrics",))
    router = RouterServer(config, tokenizer=tokenizer)
    await router.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{router.http_port}", timeout=10) as http:
            assert (await http.get("/health")).status_code == 401
            assert (await http.get("/health", headers={"authorization": "Bearer key-one"})).status_code == 503
            assert (await http.get("/metrics")).status_code == 200
    finally:
        await router.stop()
