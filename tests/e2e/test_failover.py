"""Surviving worker death: two prefill and two decode workers, real processes and the real
model; one worker is SIGKILLed in the middle of a 40-request concurrent run. Every request still
ends with the Hugging Face greedy answer (streams resumed on the other decode worker included),
and the survivors' KV gauges return to idle.

Both tests share one cluster: the supervisor restarts each victim (same port) while the pool's
deadlines free what it held, and the next test starts once every worker serves again; router
counters are compared with their values just before each kill.

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
# What a worker that died held in the pool lapses by itself (docs/design.md §5): blocks it reserved
# but never committed after the pool's reservation TTL, its leases and scoped tails after the
# lease deadline its KV connector asked for. Short here, so the idle check waits seconds, not a
# minute (the defaults are 30 s and 60 s).
PUT_RESERVATION_TTL_S = 10.0
LEASE_TTL_S = 10.0


@pytest.fixture(scope="module")
def references() -> None:
    """The HF answers, computed before any cluster starts (their CPU time stays out of the run)."""
    for prompt in reference.PROMPTS:
        expected_tokens(prompt)


@pytest.fixture(scope="module")
def two_by_two(references, tmp_path_factory):
    """2 prefill + 2 decode workers, shared by the tests of this module (each kills one worker,
    which the supervisor restarts)."""
    config = ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE, num_kv_blocks=256,
        max_model_len=1024, max_num_batched_tokens=512, num_prefill_workers=2, num_decode_workers=2,
        kv_lease_ttl_s=LEASE_TTL_S, pool_put_reservation_ttl_s=PUT_RESERVATION_TTL_S,
        log_dir=tmp_path_factory.mktemp("failover-logs"),
        # Every request prefilled on a prefill worker: each test kills a worker mid-run and needs
        # both roles streaming (conditional disaggregation may keep short prompts on a decode
        # worker that calibrated faster: tests/e2e/test_pool_nodes.py).
        disaggregation="always",
    )
    with LocalCluster(config) as cluster:
        cluster.start()
        yield cluster


@pytest.fixture
def whole(two_by_two):
    """The shared cluster with all four workers serving and seen by the router (a victim of an
    earlier test restarted), back to idle."""
    names = ("prefill", "prefill-1", "decode", "decode-1")

    def serving() -> bool:
        two_by_two.supervise()
        if not all(two_by_two.service(n).exit_code() is None and two_by_two.service(n).ready() for n in names):
            return False
        workers = httpx.get(f"{two_by_two.http_url}/health", timeout=10).json()["workers"]
        return (workers["prefill"], workers["decode"]) == (2, 2)

    poll_until(serving, timeout_s=600, interval_s=0.5, message="all four workers serving")
    poll_until(ClusterProbe(two_by_two).is_idle, timeout_s=15, message="the cluster idle before the run")
    return two_by_two


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


async def run_with_kill(cluster: LocalCluster, kill_when, victim):
    """Starts NUM_REQUESTS at once (even ones gRPC, odd ones OpenAI), SIGKILLs ``victim`` (a
    service name, or a callable giving it once ``kill_when`` held) once ``kill_when(progress)``
    holds; returns the prompts, every result in request order, the progress at the kill and the
    router's counters read just before it."""
    victim_name, label = (victim, "the victim") if callable(victim) else (lambda: victim, victim)
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
        await wait_for(lambda: kill_when(progress), progress, f"the moment to kill {label}")
        before = await asyncio.to_thread(router_counters, cluster)
        os.kill(cluster.service(victim_name()).process.pid, signal.SIGKILL)
        killed_at = (progress.first_tokens, progress.tokens)
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=REQUEST_TIMEOUT_S)
    return prompts, results, killed_at, before


def assert_all_equal_reference(prompts, results) -> None:
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        expected = expected_tokens(prompt)
        if i % 2 == 0:
            assert result == expected, (i, prompt)
        else:
            text = reference.tokenizer().decode(expected, skip_special_tokens=True)
            assert result == (text, len(expected)), (i, prompt)


COUNTERS = ("tandem:worker_failures_total", "tandem:prefill_retries_total", "tandem:migrations_total")


def router_counters(cluster: LocalCluster) -> dict[str, float]:
    """Each of COUNTERS on the router's /metrics, its samples summed."""
    body = httpx.get(f"{cluster.http_url}/metrics", timeout=10).text
    return {name: sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                      if line.startswith(name) and not line.startswith("#")) for name in COUNTERS}


def settle(cluster: LocalCluster, victim: str) -> None:
    """The survivors and the pool back to idle, within the pool's deadlines for what the victim
    held (no live component owns it any more: engine/kv_connector/connector.py): blocks it
    reserved but never committed (it died mid-write) once their reservation TTL lapses, its leases
    and scoped tails once their lease deadline does. The supervisor restarts the victim meanwhile
    (the next test waits for it to serve)."""
    probe = ClusterProbe(cluster)

    def idle() -> bool:
        cluster.supervise()
        return probe.is_idle(exclude=frozenset({victim}))

    poll_until(idle, timeout_s=max(PUT_RESERVATION_TTL_S, LEASE_TTL_S) + 15, interval_s=0.2,
               message="survivors and pool back to idle")


def busy(probe: ClusterProbe, name: str) -> bool:
    stats = probe.worker_stats(name)
    return stats.num_requests_running + stats.num_requests_waiting > 0


def test_kill_one_of_two_prefill_workers_mid_run(whole):
    probe = ClusterProbe(whole)

    def kill_when(progress: Progress) -> bool:  # some prefills done, the victim still holding some
        return progress.first_tokens >= 1 and busy(probe, "prefill-1")

    prompts, results, (first_tokens, _), before = asyncio.run(run_with_kill(whole, kill_when, "prefill-1"))
    assert_all_equal_reference(prompts, results)
    assert 1 <= first_tokens < NUM_REQUESTS  # killed in the middle
    after = router_counters(whole)
    assert after["tandem:worker_failures_total"] >= before["tandem:worker_failures_total"] + 1
    assert after["tandem:prefill_retries_total"] >= before["tandem:prefill_retries_total"] + 1
    assert probe.live_workers() == ["prefill", "decode", "decode-1"]
    settle(whole, "prefill-1")


def test_kill_one_of_two_decode_workers_mid_answer(whole):
    probe = ClusterProbe(whole)
    victim: list[str] = []

    def kill_when(progress: Progress) -> bool:
        """Answers well under way: the victim is the decode worker streaming the most of them (the
        router may place nearly all on one: the one whose prefix cache holds the chat template)."""
        if progress.tokens < NUM_REQUESTS * MAX_TOKENS // 4:
            return False
        running = {name: probe.worker_stats(name).num_requests_running for name in ("decode", "decode-1")}
        name = max(running, key=running.get)
        victim[:] = [name]
        return running[name] > 0

    prompts, results, (_, tokens), before = asyncio.run(run_with_kill(whole, kill_when, lambda: victim[0]))
    assert_all_equal_reference(prompts, results)
    assert tokens < NUM_REQUESTS * MAX_TOKENS  # killed before the end
    assert router_counters(whole)["tandem:migrations_total"] >= before["tandem:migrations_total"] + 1
    survivor = "decode-1" if victim[0] == "decode" else "decode"
    assert probe.live_workers() == ["prefill", "prefill-1", survivor]
    # A manifest the victim was sent but had not loaded yet (the request then resumes on the
    # survivor under a new id) is held by nobody alive: its leases lapse at their deadline.
    settle(whole, victim[0])

    # Request identity: two concurrent requests with one client id both answer correctly.
    prompt = reference.PROMPTS[0]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0}

    async def twice():
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S) as http:
            return await asyncio.gather(*(http.post(f"{whole.http_url}/v1/chat/completions", json=body,
                                                    headers={"x-request-id": "same-id"}) for _ in range(2)))

    expected = reference.tokenizer().decode(expected_tokens(prompt), skip_special_tokens=True)
    for reply in asyncio.run(twice()):
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "same-id"
        assert reply.json()["choices"][0]["message"]["content"] == expected
    poll_until(lambda: probe.is_idle(exclude=frozenset(victim)), timeout_s=15,
               message="back to idle after the duplicate ids")
