"""The bench client against a scripted fake OpenAI SSE server (FastAPI under uvicorn, 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from bench.arrivals import ArrivalConfig
from bench.client import ClientConfig
from bench.metrics import SLO, summarize
from bench.runner import run
from bench.workloads import BenchRequest
from tests.conftest import find_free_port

TTFT_S = 0.20
GAPS_S = [0.05, 0.25, 0.10]  # after the first token; the second gap is the longest
REFUSE_MAX_TOKENS = 999  # the fake server answers 503 to this


def fake_app(bodies: list[dict]) -> FastAPI:
    app = FastAPI()

    async def stream(body: dict, chat: bool):
        def chunk(text, finish=None):
            choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
                      else {"index": 0, "text": text, "finish_reason": finish})
            return f"data: {json.dumps({'choices': [choice], 'usage': None})}\n\n"

        await asyncio.sleep(TTFT_S)
        yield chunk("A")
        for gap_s, text in zip(GAPS_S, ["b", "c", "d"]):
            await asyncio.sleep(gap_s)
            yield chunk(text)
        yield chunk("", "length")
        prompt_tokens = len(body["prompt"]) if not chat else 7
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 4, "total_tokens": prompt_tokens + 4}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def serve(request: Request, chat: bool):
        body = await request.json()
        bodies.append(body)
        if body["max_tokens"] == REFUSE_MAX_TOKENS:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=503)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve(request, chat=True)

    return app


@contextlib.asynccontextmanager
async def fake_server():
    """Serves in the test's own event loop (an async fixture would run in the session loop)."""
    bodies: list[dict] = []
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(fake_app(bodies), host="127.0.0.1", port=port, log_level="warning"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", bodies
    server.should_exit = True
    await task


async def test_client_records_ttft_every_gap_usage_and_errors():
    requests = [BenchRequest([11, 12, 13], 4), BenchRequest("hello", 4), BenchRequest([5], REFUSE_MAX_TOKENS)]
    async with fake_server() as (url, bodies):
        result = await run(requests, ArrivalConfig("concurrency", concurrency=3),
                           ClientConfig(url, "fake", ignore_eos=True), show_progress=False)
    tokens_ok, chat_ok, refused = result.records
    for record in (tokens_ok, chat_ok):
        assert record.ok and record.finish_reason == "length"
        assert TTFT_S <= record.ttft_s < TTFT_S + 0.5  # slack: a busy 2-core machine
        gaps = record.gaps_s
        assert len(gaps) == 3
        assert all(g >= scripted - 0.005 for g, scripted in zip(gaps, GAPS_S))
        assert gaps[1] > gaps[2] > gaps[0]  # the scripted order survives the trip
        assert record.e2e_s >= record.chunk_times_s[-1] >= TTFT_S + sum(GAPS_S) - 0.01
        assert record.output_tokens == 4
    assert tokens_ok.prompt_tokens == 3 and chat_ok.prompt_tokens == 7
    assert refused.error_kind == "http_503" and "overloaded" in refused.error
    sent = {json.dumps(b.get("prompt", b.get("messages"))): b for b in bodies}
    assert sent["[11, 12, 13]"]["max_tokens"] == 4 and sent["[11, 12, 13]"]["ignore_eos"] is True
    assert sent['[{"role": "user", "content": "hello"}]']["stream_options"] == {"include_usage": True}
    summary = summarize(result.records, result.duration_s, SLO(ttft_ms=1000, tbt_ms=300))
    assert summary["num_ok"] == 2 and summary["errors_by_kind"] == {"http_503": 1}
    assert summary["slo_attainment"] == pytest.approx(2 / 3)
