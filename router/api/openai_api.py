"""The OpenAI-compatible HTTP API: completions, chat completions, models, health, metrics, and
vLLM's tokenize, detokenize, version and ping (docs/api.md lists every field and endpoint).

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
import dataclasses
import importlib.metadata
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.errors import ErrorKind, RouterError, as_json
from router.api.choices import ChoiceEvent, best_candidates, generate_choices, total_usage
from router.generation import Finished, Generation, TextDelta, Usage
from router.output.logprobs import TokenLogprob
from router.api.http_errors import BodyLimitMiddleware, http_exception_response
from router.metrics import RouterMetrics
from router.api.request_ids import client_request_id
from router.api.openai_models import ChatShape, ChoiceResult, CompletionShape, ResponseShape
from router.api.openai_requests import ChatCompletionRequest, CompletionRequest, body_error
from router.api.tokenize_requests import DetokenizeRequest, TokenizeRequest
from router.api.validation import InvalidRequestError, RequestInput, Validator, name_structured_param
from router.output.logprobs import TokenLogprob
from router.output.tool_calls import ParsedDelta, ToolCallFormat, ToolCallParser, make_parser, parse_tool_calls
from router.workers.view import WorkerView

def _package_version() -> str:
    """This server's version (the ``tandem-serve`` distribution's), "unknown" when not installed."""
    try:
        return importlib.metadata.version("tandem-serve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


T = TypeVar("T")
SERVER_VERSION = _package_version()
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
@dataclass(frozen=True)
class _Choices:
    """How a request's candidates become choices: ``per_prompt`` candidates (``best_of``) of
    which ``n`` are returned, and each prompt's text when ``echo`` asked for it."""

    n: int
    per_prompt: int
    echo_texts: list[str] | None = None
    first_prompt_tokens: list[int] | None = None  # each prompt's first token, with echo and logprobs

    def echo(self, index: int) -> str:
        """The echoed prompt of choice ``index`` ("" without echo)."""
        return "" if self.echo_texts is None else self.echo_texts[index // self.n]

    def prompt_logprobs(self, candidate: int, delta: TextDelta) -> tuple[TokenLogprob, ...]:
        """The echoed prompt's logprobs of ``candidate``, given its first delta (which carries
        them): the prompt's first token without one (it has no context), then the rest's."""
        if self.first_prompt_tokens is None:
            return ()
        first = self.first_prompt_tokens[candidate // self.per_prompt]
        return (TokenLogprob(first, None), *delta.prompt_logprobs)


class OpenAIApi:
    """Builds the FastAPI app over the shared validator and generation."""

    def __init__(self, validator: Validator, generation: Generation, view: WorkerView, metrics: RouterMetrics):
        self.validator, self.generation, self.view, self.metrics = validator, generation, view, metrics
        self.token_text = validator.tokenizer.token_text
        self.token_bytes = validator.tokenizer.token_bytes
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
        app.get("/v1/models/{model_id:path}")(self._model)
        app.post("/tokenize")(self._tokenize)
        app.post("/detokenize")(self._detokenize)
        app.get("/version")(self._version)
        app.api_route("/ping", methods=["GET", "POST"])(self._ping)
        app.get("/health")(self._health)
        app.get("/metrics")(self._metrics)

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "tandem",
                "max_model_len": self.validator.max_model_len}

    async def _models(self) -> dict:
        return {"object": "list", "data": [self._model_card()]}

    async def _model(self, model_id: str) -> dict:
        """The served model's card; another id is a 404 (``model_not_found``)."""
        if model_id != self.model:
            raise InvalidRequestError(f"model {as_json(model_id)} does not exist; this cluster serves "
                                      f"{as_json(self.model)}", "model", ErrorKind.MODEL_NOT_FOUND)
        return self._model_card()

    async def _tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's ``/tokenize``: the prompt's (or the rendered chat's) token ids; no context check."""
        ids = await asyncio.to_thread(self.validator.tokenize, body.to_input())
        strs = self.validator.tokenizer.hf.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.validator.max_model_len, "tokens": ids, "token_strs": strs}

    async def _detokenize(self, body: DetokenizeRequest) -> dict:
        """vLLM's ``/detokenize``: the text of ``tokens``, special tokens included."""
        self.validator.check_model(body.model)
        self.validator.check_token_ids(body.tokens, "tokens")
        text = await asyncio.to_thread(self.validator.tokenizer.decode, body.tokens, False)
        return {"prompt": text}

    async def _version(self) -> dict:
        return {"version": SERVER_VERSION}

    async def _ping(self) -> Response:
        """vLLM's ``/ping`` (SageMaker's probe): ``/health``'s status with an empty body."""
        return Response(status_code=(await self._health()).status_code)

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
            inputs = body.to_inputs()
            validated = [await self.validator.validate_async(one) for one in inputs]
            # The client's x-request-id: echoed and logged, never a key inside the cluster.
            header_id = request.headers.get("x-request-id")
            header_id = client_request_id(header_id, "x-request-id", "") if header_id else ""
        except InvalidRequestError as err:
            self.metrics.rejected(err.kind.value)
            raise
        logprobs = inputs[0].sampling.get("logprobs") is not None  # as asked (best_of forces them on inside)
        shape = shape_type(f"{shape_type.id_prefix}{uuid.uuid4().hex}", self.model, int(time.time()),
                           self.token_text if logprobs else None, self.token_bytes if logprobs else None)
        trace_id = header_id or shape.request_id
        events = generate_choices(self.generation, trace_id, validated, arrival_time_s)
        headers = {"x-request-id": trace_id}
        tool_format = validated[0].tool_format
        echo = getattr(body, "echo", False)
        choices = _Choices(validated[0].n, validated[0].num_candidates,
                           [self._echo_text(one) for one in inputs] if echo else None,
                           [one.prompt_token_ids[0] for one in validated] if echo and logprobs else None)
        try:
            if body.stream:
                first = await _unless_disconnected(request, anext(events))
                stream = self._stream(events, first, shape, body.include_usage, choices, tool_format)
                return StreamingResponse(stream, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", **headers})
            answer = await _unless_disconnected(request, self._collect(events, shape, choices, tool_format))
            return JSONResponse(answer, headers=headers)
        except RouterError as err:
            raise name_structured_param(err, validated[0]) from None
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)

    def _echo_text(self, request: RequestInput) -> str:
        """A prompt's text as ``echo`` returns it: as sent, or its token ids decoded."""
        if request.prompt is not None:
            return request.prompt
        return self.validator.tokenizer.decode(list(request.prompt_token_ids or ()), skip_special_tokens=False)

    async def _collect(self, events: AsyncIterator[ChoiceEvent], shape: ResponseShape, choices: _Choices,
                       tool_format: ToolCallFormat | None = None) -> dict:
        """Gathers every candidate; answers once the last one finished (with ``best_of``, the
        best ``n`` of each prompt's candidates). With ``tool_format`` each choice's text is read
        for tool calls (router.output.tool_calls)."""
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list] = {}
        prompt_logprobs: dict[int, tuple] = {}  # echo with logprobs
        finished: dict[int, Finished] = {}
        async with contextlib.aclosing(events):
            async for choice in events:
                i, event = choice.index, choice.event
                if isinstance(event, Finished):
                    finished[i] = event
                    continue
                if i not in texts:
                    prompt_logprobs[i] = choices.prompt_logprobs(i, event)
                texts.setdefault(i, []).append(event.text)
                logprobs.setdefault(i, []).extend(event.logprobs)
        if not finished:
            raise RouterError("generation ended without finishing", ErrorKind.UNAVAILABLE)
        candidates = []
        for i in sorted(finished):
            text, calls = "".join(texts.get(i, [])), []
            if tool_format is not None:
                text, calls = parse_tool_calls(tool_format, text)
            reason = _finish_reason(finished[i].finish_reason.value, len(calls))
            candidates.append(ChoiceResult(i, text, reason, tuple(logprobs.get(i, [])), tuple(calls)))
        usage = total_usage([finished[i].usage for i in sorted(finished)], choices.per_prompt)
        best = best_candidates(candidates, choices.per_prompt, choices.n, lambda c: sum(lp.logprob for lp in c.logprobs))
        results = [dataclasses.replace(c, index=i, text=choices.echo(i) + c.text,
                                       logprobs=prompt_logprobs.get(c.index, ()) + c.logprobs) for i, c in best]
        return shape.response(results, usage)

    async def _stream(
        self, events: AsyncIterator[ChoiceEvent], first: ChoiceEvent, shape: ResponseShape, include_usage: bool,
        choices: _Choices, tool_format: ToolCallFormat | None = None,
    ) -> AsyncIterator[str]:
        """SSE chunks: each choice's text deltas (with its index; the first after its echoed
        prompt) and finish chunk, then optionally one usage chunk for all choices, then
        ``[DONE]``. With ``tool_format`` each choice's text goes through its tool call parser:
        content deltas, then one chunk per ``delta.tool_calls`` piece."""
        async with contextlib.aclosing(events):
            started: set[int] = set()  # choices whose first chunk went out
            usages: dict[int, Usage] = {}
            parsers: dict[int, ToolCallParser] = {}
            choice: ChoiceEvent | None = first
            try:
                while choice is not None:
                    i, event = choice.index, choice.event
                    parser = None if tool_format is None else parsers.setdefault(i, make_parser(tool_format))
                    echo = "" if i in started else choices.echo(i)
                    if isinstance(event, Finished):
                        reason = event.finish_reason.value
                        if parser is not None:
                            for chunk in self._chunks(shape, i, parser.finish(), (), started, include_usage):
                                yield _sse(chunk)
                            reason = _finish_reason(reason, len(parser.calls))
                        yield _sse(shape.chunk(i, echo, reason, i not in started, include_usage))
                        started.add(i)
                        usages[i] = event.usage
                    elif parser is not None:
                        for chunk in self._chunks(shape, i, parser.feed(event.text), event.logprobs, started,
                                                  include_usage):
                            yield _sse(chunk)
                    elif event.text or event.logprobs or i not in started:  # a first chunk goes out at once
                        logprobs = event.logprobs if i in started else choices.prompt_logprobs(i, event) + event.logprobs
                        yield _sse(shape.chunk(i, echo + event.text, None, i not in started, include_usage, logprobs))
                        started.add(i)
                    choice = await anext(events, None)
                if include_usage and usages:
                    yield _sse(shape.usage_chunk(total_usage([usages[i] for i in sorted(usages)], choices.per_prompt)))
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
