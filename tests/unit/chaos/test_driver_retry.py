"""The chaos client's retry rule with several routers (chaos.driver): a request whose router dies
under it (refused, cut mid-stream, 503 shutting_down) is sent again, whole, to the next router;
anything else the cluster answers is kept. Routers are httpx mock transports, so each failure is
exactly the one named."""

from __future__ import annotations

import json

import httpx

from bench.client import ClientConfig
from bench.workloads import BenchRequest
from chaos.driver import MAX_ATTEMPTS, Driver

ROUTERS = ("http://router-0", "http://router-1")
WORDS = ["The", " answer", " is", " 42", "."]


def sse(words: list[str], finish: bool = True) -> list[bytes]:
    chunks = [b"data: " + json.dumps({"choices": [{"delta": {"content": w}, "finish_reason": None}]}).encode() + b"\n\n"
              for w in words]
    if finish:
        chunks.append(b"data: " + json.dumps({"choices": [{"delta": {}, "finish_reason": "stop"}]}).encode() + b"\n\n")
        chunks.append(b"data: [DONE]\n\n")
    return chunks


class Body(httpx.AsyncByteStream):
    """An SSE body; ``cut`` raises the error a reset connection gives after the chunks."""

    def __init__(self, chunks: list[bytes], cut: bool = False):
        self.chunks, self.cut = chunks, cut

    async def __aiter__(self):
        for chunk in self.chunks:
            yield chunk
        if self.cut:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")


def routers(behaviour: dict[str, str]) -> tuple[httpx.MockTransport, list[str]]:
    """A transport where each router host does what ``behaviour`` says (default: answers)."""
    calls: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        calls.append(host)
        what = behaviour.get(host, "answer")
        if what == "refuse":
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        if what == "cut":
            return httpx.Response(200, stream=Body(sse(WORDS[:2], finish=False), cut=True))
        if what == "eof":
            return httpx.Response(200, stream=Body(sse(WORDS[:2], finish=False)))
        if what in ("shutting_down", "no_worker"):
            return httpx.Response(503, json={"error": {"code": what, "message": what}})
        return httpx.Response(200, stream=Body(sse(WORDS)))

    return httpx.MockTransport(handle), calls


async def drive(behaviour: dict[str, str], urls: tuple[str, ...] = ROUTERS, num_requests: int = 2):
    transport, calls = routers(behaviour)
    driver = Driver([BenchRequest("q", 5)] * num_requests, ClientConfig(urls[0], "m"), concurrency=1,
                    deadline_s=10, seed=0, router_urls=urls, transport=transport)
    return await driver.run(), calls


async def test_requests_are_spread_over_the_routers():
    outcomes, calls = await drive({})
    assert calls == ["router-0", "router-1"]
    assert [(o.status, o.text, o.num_attempts, o.router_index) for o in outcomes] == [
        ("completed", "The answer is 42.", 1, 0), ("completed", "The answer is 42.", 1, 1)]


async def test_a_refused_connection_is_retried_on_the_next_router():
    outcomes, calls = await drive({"router-0": "refuse"}, num_requests=1)
    (o,) = outcomes
    assert calls == ["router-0", "router-1"]
    assert (o.status, o.text, o.retried, o.router_index, o.error) == ("completed", "The answer is 42.", True, 1, "")


async def test_a_stream_cut_mid_answer_is_sent_again_whole_and_its_partial_text_dropped():
    for cut in ("cut", "eof"):  # a reset connection; a body that just ends without finish reason
        outcomes, calls = await drive({"router-0": cut}, num_requests=1)
        (o,) = outcomes
        assert calls == ["router-0", "router-1"], cut
        assert (o.status, o.text, o.num_tokens, o.num_attempts) == ("completed", "The answer is 42.", 5, 2), cut


async def test_a_shutting_down_router_is_retried_but_a_cluster_error_is_kept():
    outcomes, calls = await drive({"router-0": "shutting_down"}, num_requests=1)
    assert calls == ["router-0", "router-1"] and outcomes[0].status == "completed"
    outcomes, calls = await drive({"router-0": "no_worker"}, num_requests=1)
    assert calls == ["router-0"]
    assert outcomes[0].status == "error" and outcomes[0].error.startswith("HTTP 503") and not outcomes[0].retried


async def test_retries_stop_after_max_attempts():
    outcomes, calls = await drive({"router-0": "refuse", "router-1": "refuse"}, num_requests=1)
    assert calls == ["router-0", "router-1", "router-0"] and MAX_ATTEMPTS == 3
    assert outcomes[0].status == "lost" and outcomes[0].error.endswith("(after 3 attempts)")


async def test_a_lone_router_is_never_retried():
    outcomes, calls = await drive({"router-0": "refuse"}, urls=ROUTERS[:1], num_requests=1)
    assert calls == ["router-0"] and (outcomes[0].status, outcomes[0].retried) == ("error", False)
    outcomes, calls = await drive({"router-0": "cut"}, urls=ROUTERS[:1], num_requests=1)
    assert calls == ["router-0"] and outcomes[0].status == "lost"
