"""Surviving worker death: two prefill and two decode workers, real processes and the real
model; one worker is SIGKILLed in the middle of a 40-request concurrent run. Every request still
ends with the Hugging Face greedy answer (streams resumed on the other decode worker included),
and the survivors' KV gauges return to idle.

Half the requests go through the OpenAI client (streaming chat, compared as text), half through
gRPC (streaming, compared token for token). The kill waits for the state it needs by polling
GetStats and the streams' progress, never by sleeping.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

import grpc
import httpx
import openai
import pytest

from kv_pool.config import PoolConfig
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 24
NUM_REQUESTS = 40
REQUEST_TIMEOUT_S = 150.0
PUT_RESERVATION_TTL_S = PoolConfig().put_reservation_ttl_s
# Leases and scoped blocks of a worker that died lapse by themselves after this (docs/design.md §5):
# the pool's default for scoped blocks, and what the workers' KV connectors ask for their leases.
LEASE_TTL_S = PoolConfig().lease_ttl_s


@pytest.fixture(scope="module")
def references() -> None:
    """The HF answers, computed before any cluster starts (their CPU time stays out of the run)."""
    for prompt in reference.PROMPTS:
        expected_tokens(prompt)


@pytest.fixture
def two_by_two(references, tmp_path):
    """A fresh cluster of 2 prefill + 2 decode workers (each test kills one of them)."""
    config = ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE, num_kv_blocks=256,
        max_model_len=1024, max_num_batched_tokens=512, num_prefill_workers=2, num_decode_workers=2,
        log_dir=tmp_path / "logs",
    )
    with LocalCluster(config) as cluster:
        cluster.start()
        yield cluster


@dataclass
class Progress:
    """What the client side has seen so far, for the kill's trigger."""

    first_tokens: int = 0  # requests that received their first token
    tokens: int = 0  # tokens received, all requests together
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, num_tokens: int, first: bool) -> None:
        self.tokens += num_tokens
        self.first_tokens += first
        self.changed.set()


def expected_tokens(prompt: str) -> list[int]:
    return reference.hf_greedy(reference.chat_ids(prompt), MAX_TOKENS)


async def grpc_request(stub, prompt: str, progress: Progress) -> list[int]:
    params = common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    chat = router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=prompt)])
    tokens: list[int] = []
    async for msg in stub.Generate(router_pb2.GenerateRequest(chat=chat, sampling_params=params)):
        if msg.HasField("delta") and msg.delta.token_ids:
            progress.add(len(msg.delta.token_ids), not tokens)
            tokens += msg.delta.token_ids
    return tokens


async def openai_request(client: openai.AsyncOpenAI, prompt: str, progress: Progress) -> tuple[str, int]:
    text, usage, first = "", None, True
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            progress.add(1, first)
            first = False
        usage = chunk.usage or usage
    return text, usage.completion_tokens


async def wait_for(condition, progress: Progress, message: str, timeout_s: float = 120.0) -> None:
    """Re-checks ``condition`` (GetStats calls run in a thread) at each client-side progress."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(condition):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {message}")
        progress.changed.clear()
        try:
            await asyncio.wait_for(progress.changed.wait(), timeout=0.5)
        except TimeoutError:
            pass  # no token for a while (a prefill batch running): check the stats again


async def run_with_kill(cluster: LocalCluster, kill_when, victim: str):
    """Starts NUM_REQUESTS at once (even ones gRPC, odd ones OpenAI), SIGKILLs ``victim`` once
    ``kill_when(progress)`` holds, and returns every result in request order."""
    prompts = [reference.PROMPTS[i % len(reference.PROMPTS)] for i in range(NUM_REQUESTS)]
    progress = Progress()
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel, openai.AsyncOpenAI(
        base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S,
    ) as client:
        stub = router_pb2_grpc.RouterStub(channel)
        tasks = [
            asyncio.create_task(grpc_request(stub, p, progress) if i % 2 == 0 else openai_request(client, p, progress))
            for i, p in enumerate(prompts)
        ]
        await wait_for(lambda: kill_when(progress), progress, f"the moment to kill {victim}")
        os.kill(cluster.service(victim).process.pid, signal.SIGKILL)
        killed_at = (progress.first_tokens, progress.tokens)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=REQUEST_TIMEOUT_S)
    return prompts, results, killed_at


def assert_all_equal_reference(prompts, results) -> None:
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        expected = expected_tokens(prompt)
        if i % 2 == 0:
            assert result == expected, (i, prompt)
        else:
            text = reference.tokenizer().decode(expected, skip_special_tokens=True)
            assert result == (text, len(expected)), (i, prompt)


def router_counter(cluster: LocalCluster, name: str) -> float:
    """Sum of a counter's samples on the router's /metrics."""
    body = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def busy(probe: ClusterProbe, name: str) -> bool:
    stats = probe.worker_stats(name)
    return stats.num_requests_running + stats.num_requests_waiting > 0


def test_kill_one_of_two_prefill_workers_mid_run(two_by_two):
    probe = ClusterProbe(two_by_two)

    def kill_when(progress: Progress) -> bool:  # some prefills done, the victim still holding some
        return progress.first_tokens >= 1 and busy(probe, "prefill-1")

    prompts, results, (first_tokens, _) = asyncio.run(run_with_kill(two_by_two, kill_when, "prefill-1"))
    assert_all_equal_reference(prompts, results)
    assert 1 <= first_tokens < NUM_REQUESTS  # killed in the middle
    assert router_counter(two_by_two, "tandem:worker_failures_total") >= 1
    assert router_counter(two_by_two, "tandem:prefill_retries_total") >= 1
    assert probe.live_workers() == ["prefill", "decode", "decode-1"]
    # What the victim held in the pool goes by the pool's own deadlines (no live component owns
    # it any more: engine/kv_connector/connector.py): blocks it reserved but never committed (it
    # died mid-write) once their reservation TTL (30 s) lapses, its leases and scoped tails once
    # their lease deadline (60 s) does.
    poll_until(probe.is_idle, timeout_s=max(PUT_RESERVATION_TTL_S, LEASE_TTL_S) + 15,
               message="survivors and pool back to idle")


def test_kill_one_of_two_decode_workers_mid_answer(two_by_two):
    probe = ClusterProbe(two_by_two)

    def kill_when(progress: Progress) -> bool:  # both decode workers streaming, answers well under way
        return (progress.tokens >= NUM_REQUESTS * MAX_TOKENS // 4
                and busy(probe, "decode") and probe.worker_stats("decode-1").num_requests_running > 0)

    prompts, results, (_, tokens) = asyncio.run(run_with_kill(two_by_two, kill_when, "decode-1"))
    assert_all_equal_reference(prompts, results)
    assert tokens < NUM_REQUESTS * MAX_TOKENS  # killed before the end
    assert router_counter(two_by_two, "tandem:migrations_total") >= 1
    assert probe.live_workers() == ["prefill", "prefill-1", "decode"]
    # A manifest the victim was sent but had not loaded yet (the request then resumes on the
    # survivor under a new id) is held by nobody alive: its leases lapse at their deadline.
    poll_until(probe.is_idle, timeout_s=LEASE_TTL_S + 15, message="survivors and pool back to idle")

    # Request identity: two concurrent requests with one client id both answer correctly.
    prompt = reference.PROMPTS[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0}

    async def twice():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            return await asyncio.gather(*(http.post(f"{two_by_two.http_url}/v1/chat/completions", json=body,
                                                    headers={"x-request-id": "same-id"}) for _ in range(2)))

    expected = reference.tokenizer().decode(expected_tokens(prompt), skip_special_tokens=True)
    for reply in asyncio.run(twice()):
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "same-id"
        assert reply.json()["choices"][0]["message"]["content"] == expected
    poll_until(probe.is_idle, timeout_s=15, message="back to idle after the duplicate ids")
