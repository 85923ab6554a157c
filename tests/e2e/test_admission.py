"""SLO admission on a real cluster (real processes, real model): a burst far beyond what the
workers can prefill within a tight TTFT SLO gets some HTTP 429s (gRPC RESOURCE_EXHAUSTED) with a
Retry-After, never a timeout, and every admitted request answers exactly the HF greedy reference."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest
import redis

from launcher.config import ClusterConfig

from launcher.local_cluster import LocalCluster

from launcher.ports import free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 8
NUM_HTTP, NUM_GRPC = 14, 4
TTFT_SLO_S, MAX_QUEUE_S = 0.05, 0.05  # no prefill on this CPU takes 50 ms: only queue depth decides


@pytest.fixture(scope="module")
def slo_cluster(tmp_path_factory):
    config = ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE, num_kv_blocks=256,
        max_model_len=1024, max_num_batched_tokens=512, log_dir=tmp_path_factory.mktemp("admission-logs"),
        ttft_slo_s=TTFT_SLO_S, max_queue_s=MAX_QUEUE_S,
    )
    with LocalCluster(config) as cluster:
        cluster.start()
        yield cluster


def prompt_ids(i: int) -> list[int]:
    topic = ["rivers", "stars", "bread", "chess", "rain", "glass", "bees", "maps", "salt", "clocks"][i % 10]
    return reference.chat_ids(f"Request {i}. Write three careful sentences about {topic}, then explain why "
                              f"{topic} matter to people who live far from cities, with one example each.")


def workers_have_cost_models(redis_url: str) -> bool:
    """Both workers advertise a fitted cost model (start-up calibration) in their heartbeat."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        loads = [json.loads(v)["load"] for v in client.mget(client.keys("tandem:workers:*")) if v]
        return sum(1 for load in loads if load.get("cost_num_samples", 0) > 0) >= 2
    finally:
        client.close()


async def http_completion(client: httpx.AsyncClient, url: str, ids: list[int]) -> tuple[int, dict, str]:
    body = {"model": MODEL, "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    reply = await client.post(f"{url}/v1/completions", json=body, timeout=300)
    text = reply.json()["choices"][0]["text"] if reply.status_code == 200 else ""
    return reply.status_code, dict(reply.headers), text


async def grpc_generate(stub, ids: list[int]):
    """(token ids, None) or (None, (status code, trailing metadata))."""
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    call = stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids), sampling_params=params),
                         timeout=300)
    tokens = []
    try:
        async for msg in call:
            if msg.HasField("delta"):
                tokens += msg.delta.token_ids
    except grpc.aio.AioRpcError as err:
        return None, (err.code(), dict(err.trailing_metadata() or ()))
    return tokens, None


async def http_burst(cluster: LocalCluster, prompts: list[list[int]]):
    async with httpx.AsyncClient() as http:
        return await asyncio.gather(*[http_completion(http, cluster.http_url, ids) for ids in prompts])


async def grpc_burst(cluster: LocalCluster, prompts: list[list[int]]):
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        return await asyncio.gather(*[grpc_generate(stub, ids) for ids in prompts])


def test_burst_beyond_capacity_gets_429s_and_correct_answers(slo_cluster: LocalCluster) -> None:
    """HTTP burst, then (back at idle) a gRPC burst: the first request of each finds empty queues
    and is admitted; those behind it find more than MAX_QUEUE_S of queued prefill and are refused."""
    poll_until(lambda: workers_have_cost_models(slo_cluster.redis_url), timeout_s=60, message="fitted cost models")
    probe = ClusterProbe(slo_cluster)
    prompts = [prompt_ids(i) for i in range(NUM_HTTP + NUM_GRPC)]
    tok = reference.tokenizer()

    http_results = asyncio.run(http_burst(slo_cluster, prompts[:NUM_HTTP]))
    statuses = [status for status, _, _ in http_results]
    assert set(statuses) <= {200, 429}, statuses  # nothing timed out or failed otherwise
    assert 200 in statuses and 429 in statuses, statuses
    for ids, (status, headers, text) in zip(prompts, http_results):
        if status == 200:
            assert text == tok.decode(reference.hf_greedy(ids, MAX_TOKENS), skip_special_tokens=True)
        else:
            assert int(headers["retry-after"]) >= 1
    poll_until(probe.is_idle, timeout_s=10, message="cluster back to idle")

    grpc_results = asyncio.run(grpc_burst(slo_cluster, prompts[NUM_HTTP:]))
    assert any(failure is None for _, failure in grpc_results) and any(failure for _, failure in grpc_results)
    for ids, (tokens, failure) in zip(prompts[NUM_HTTP:], grpc_results):
        if failure is None:
            assert tokens == reference.hf_greedy(ids, MAX_TOKENS)
        else:
            code, metadata = failure
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and int(metadata["retry-after"]) >= 1

    metrics = httpx.get(f"{slo_cluster.http_url}/metrics", timeout=10).text
    num_refused = statuses.count(429) + sum(1 for _, failure in grpc_results if failure is not None)
    assert f'tandem:rejections_total{{reason="slo_unattainable"}} {float(num_refused)}' in metrics
    poll_until(probe.is_idle, timeout_s=10, message="cluster back to idle")
