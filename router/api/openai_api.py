"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``: bad input 400 (also
malformed JSON, unknown fields and wrong types, where FastAPI would say 422), unknown model or
path 404, a body over 16 MiB 413 (router.api.http_errors), worker overload
429, no healthy worker or a worker failure 503. A failure after the first chunk was streamed
ends the stream with a ``finish_reason: "abort"`` chunk, an ``{"error": ...}`` event and
``[DONE]``; so does a stream still running when the router stops (code ``shutting_down``, after
the grace period; new requests then get 503, router.shutdown). A client that disconnects cancels
its request's worker calls at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.errors import ErrorKind, RouterError
from router.api.choices import ChoiceEvent, generate_choices, total_usage
from router.generation import Finished, Generation
from router.api.http_errors import BodyLimitMiddleware, http_exception_response
from router.metrics import RouterMetrics
from router.api.request_ids import client_request_id
from router.api.openai_models import ChatShape, ChoiceResult, CompletionShape, ResponseShape
from router.api.openai_requests import ChatCompletionRequest, CompletionRequest, body_error
from router.api.validation import InvalidRequestError, Validator, name_structured_param
from router.output.logprobs import TokenLogprob
from router.output.tool_calls import ParsedDelta, ToolCallFormat, ToolCallParser, make_parser, parse_tool_calls
from router.workers.view import WorkerView

T = TypeVar("T")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; never actually delivered


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits ``work``, cancelling it as soon as the client disconnects.

    Raises:
        ClientDisconnected: the client left first (``work`` was cancelled and has cleaned up).
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


def _finish_reason(reason: str, num_tool_calls: int) -> str:
    """OpenAI's ``tool_calls`` for a choice that ended by itself after calling tools."""
    return "tool_calls" if num_tool_calls and reason == "stop" else reason


class OpenAIApi:
    """Builds the FastAPI app over the shared validator and generation."""

    def __init__(self, validator: Validator, generation: Generation, view: WorkerView, metrics: RouterMetrics):
        self.validator, self.generation, self.view, self.metrics = validator, generation, view, metrics
        self.token_text = validator.tokenizer.token_text
        self.model = validator.served_model_name
        self.app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)
        self.app.add_middleware(BodyLimitMiddleware)
        self._add_routes()

    def _add_routes(self) -> None:
        app = self.app

        @app.exception_handler(RouterError)
        async def _router_error(_: Request, err: RouterError) -> JSONResponse:
            return JSONResponse(err.to_openai(), status_code=err.http_status, headers=err.http_headers())

        @app.exception_handler(RequestValidationError)
        async def _bad_body(request: Request, err: RequestValidationError) -> JSONResponse:
            self.metrics.rejected(ErrorKind.INVALID_REQUEST.value)
            json_body = "json" in request.headers.get("content-type", "")
            error = body_error(list(err.errors()), json_body)
            return JSONResponse(error.to_openai(), status_code=error.http_status)

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
            return http_exception_response(request, err)

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest, request: Request) -> Response:
            return await self._serve(body, CompletionShape, request)

        @app.post("/v1/chat/completions")
        async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
            return await self._serve(body, ChatShape, request)

        app.get("/v1/models")(self._models)
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)

    async def _models(self) -> dict:
        card = {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tandem",
                "max_model_len": self.validator.max_model_len}
        return {"object": "list", "data": [card]}

    async def _health(self) -> JSONResponse:
        """200 when a decode worker is live (with no prefill worker the cluster runs colocated:
        decode workers prefill locally; ``colocated_fallback`` when it had prefill workers and
        lost them, router.placement.fallback), else 503 saying what is missing."""
        counts = {role: len(self.view.workers(role)) for role in ("prefill", "decode", "pool")}
        if self.generation.shutdown.stopping:
            return JSONResponse({"status": "shutting_down", "reason": "the router is stopping", "workers": counts},
                                status_code=503)
        if counts["decode"] == 0:
            return JSONResponse(
                {"status": "unavailable", "reason": "no decode worker is registered", "workers": counts},
                status_code=503,
            )
        fallbacks = self.generation.fallbacks
        return JSONResponse({"status": "ok", "mode": fallbacks.mode(counts["prefill"]), "workers": counts,
                             "colocated_fallbacks": dict(fallbacks.counts)})

    async def _metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _serve(
        self, body: CompletionRequest | ChatCompletionRequest, shape_type: type[ResponseShape], request: Request
    ) -> Response:
        """Validates, starts generation and answers as a stream or as one JSON body.

        Raises:
            RouterError: the request was refused before any token (the handler renders it).
        """
        arrival_time_s = time.monotonic()
        try:
            validated = await self.validator.validate_async(body.to_input())
            # The client's x-request-id: echoed and logged, never a key inside the cluster.
            header_id = request.headers.get("x-request-id")
            header_id = client_request_id(header_id, "x-request-id", "") if header_id else ""
        except InvalidRequestError as err:
            self.metrics.rejected(err.kind.value)
            raise
        token_text = self.token_text if validated.sampling_params.logprobs is not None else None
        shape = shape_type(f"{shape_type.id_prefix}{uuid.uuid4().hex}", self.model, int(time.time()), token_text)
        trace_id = header_id or shape.request_id
        events = generate_choices(self.generation, trace_id, validated, arrival_time_s)
        headers = {"x-request-id": trace_id}
        tool_format = validated.tool_format
        try:
            if body.stream:
                first = await _unless_disconnected(request, anext(events))
                stream = self._stream(events, first, shape, body.include_usage, tool_format)
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            collected = await _unless_disconnected(request, self._collect(events, shape, tool_format))
            return JSONResponse(collected, headers=headers)
        except RouterError as err:
            raise name_structured_param(err, validated) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    async def _collect(
        self, events: AsyncIterator[ChoiceEvent], shape: ResponseShape, tool_format: ToolCallFormat | None = None
    ) -> dict:
        """Gathers every choice; answers once the last one finished. With ``tool_format`` each
        choice's text is read for tool calls (router.output.tool_calls)."""
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list] = {}
        finished: dict[int, Finished] = {}
        async with contextlib.aclosing(events):
            async for choice in events:
                i, event = choice.index, choice.event
                if isinstance(event, Finished):
                    finished[i] = event
                    continue
                texts.setdefault(i, []).append(event.text)
                logprobs.setdefault(i, []).extend(event.logprobs)
        if not finished:
            raise RouterError("generation ended without finishing", ErrorKind.UNAVAILABLE)
        choices = []
        for i in sorted(finished):
            text, calls = "".join(texts.get(i, [])), []
            if tool_format is not None:
                text, calls = parse_tool_calls(tool_format, text)
            reason = _finish_reason(finished[i].finish_reason.value, len(calls))
            choices.append(ChoiceResult(i, text, reason, tuple(logprobs.get(i, [])), tuple(calls)))
        return shape.response(choices, total_usage([finished[i].usage for i in sorted(finished)]))

    async def _stream(
        self, events: AsyncIterator[ChoiceEvent], first: ChoiceEvent, shape: ResponseShape, include_usage: bool,
        tool_format: ToolCallFormat | None = None,
    ) -> AsyncIterator[str]:
        """SSE chunks: each choice's text deltas (with its index) and finish chunk, then
        optionally one usage chunk for all choices, then ``[DONE]``. With ``tool_format`` each
        choice's text goes through its tool call parser: content deltas, then one chunk per
        ``delta.tool_calls`` piece."""
        async with contextlib.aclosing(events):
            started: set[int] = set()  # choices whose first chunk went out
            usages = []
            parsers: dict[int, ToolCallParser] = {}
            choice: ChoiceEvent | None = first
            try:
                while choice is not None:
                    i, event = choice.index, choice.event
                    parser = None if tool_format is None else parsers.setdefault(i, make_parser(tool_format))
                    if isinstance(event, Finished):
                        reason = event.finish_reason.value
                        if parser is not None:
                            for chunk in self._chunks(shape, i, parser.finish(), (), started, include_usage):
                                yield _sse(chunk)
                            reason = _finish_reason(reason, len(parser.calls))
                        yield _sse(shape.chunk(i, "", reason, i not in started, include_usage))
                        started.add(i)
                        usages.append(event.usage)
                    else:
                        parsed = ParsedDelta(event.text) if parser is None else parser.feed(event.text)
                        for chunk in self._chunks(shape, i, parsed, event.logprobs, started, include_usage):
                            yield _sse(chunk)
                    choice = await anext(events, None)
                if include_usage and usages:
                    yield _sse(shape.usage_chunk(total_usage(usages)))
            except RouterError as err:
                yield _sse(shape.chunk(0, "", "abort", 0 not in started, include_usage))
                yield _sse(err.to_openai())
            yield _sse("[DONE]")

    @staticmethod
    def _chunks(shape: ResponseShape, index: int, parsed: ParsedDelta, logprobs: tuple[TokenLogprob, ...],
                started: set[int], include_usage: bool) -> list[dict]:
        """The chunks of one piece of choice ``index``: its content (and logprobs; a choice's
        first chunk goes out at once, empty or not), then each tool call piece. Mutates
        ``started``."""
        chunks = []
        if parsed.content or logprobs or index not in started:
            chunks.append(shape.chunk(index, parsed.content, None, index not in started, include_usage, logprobs))
            started.add(index)
        for delta in parsed.tool_calls:
            chunks.append(shape.chunk(index, "", None, False, include_usage, (), (delta,)))
        return chunks
