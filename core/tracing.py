"""OpenTelemetry traces across router → prefill → pool → decode (off unless configured).

Turned on by an OTLP endpoint: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (e.g. ``http://collector:4317``,
OTLP over gRPC), read here and nowhere else, or by :func:`configure` (tests: an in-memory
exporter). While off, nothing is added to any call: no interceptor, no header.

While on:

- every gRPC server (core.grpc_service) opens a SERVER span per RPC, named by its method
  (``tandem.v1.PrefillWorker/Prefill``), as a child of the caller's span when the call carries a
  W3C ``traceparent`` in its metadata, with the request's ``request_id`` as ``tandem.request_id``;
- every channel to a Tandem service (core.grpc_auth) sends the current span as ``traceparent``;
- the router opens a span per HTTP request (router.api.http_tracing), a child of the client's
  ``traceparent`` header when there is one, so a client's trace continues through the cluster.

The router's spans carry its request id; a worker's carry the router's per-attempt id
``<request id>-<12 hex digits>``: the request id joins them even where a span's parent is lost.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import grpc
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
REQUEST_ID_ATTRIBUTE = "tandem.request_id"

_provider: TracerProvider | None = None  # this process's; None: tracing off


def configure(service_name: str, exporter: SpanExporter | None = None, endpoint: str = "") -> bool:
    """Turns tracing on for this process: spans go to ``exporter`` (as they end), else to the
    OTLP ``endpoint`` (batched). Returns False, changing nothing, when neither is given or
    tracing is already on."""
    global _provider
    if _provider is not None or (exporter is None and not endpoint):
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    _provider = provider
    return True


def configure_from_env(service_name: str, env: Mapping[str, str] | None = None) -> bool:
    """:func:`configure` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` (unset: off)."""
    return configure(service_name, endpoint=(os.environ if env is None else env).get(ENDPOINT_ENV, ""))


def reset() -> None:
    """Turns tracing off again, flushing what was recorded (tests)."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = None


def enabled() -> bool:
    return _provider is not None


def tracer() -> trace.Tracer:
    """This process's tracer (a no-op one while tracing is off)."""
    return (_provider or trace.NoOpTracerProvider()).get_tracer("tandem")


def inject_metadata() -> list[tuple[str, str]]:
    """The current span as W3C trace-context metadata (``traceparent``, ...); [] when none."""
    carrier: dict[str, str] = {}
    inject(carrier)
    return list(carrier.items())


class TracingInterceptor(grpc.aio.ServerInterceptor):
    """Opens a SERVER span around every RPC of an asyncio server (see the module docstring)."""

    def __init__(self, server_name: str):
        self.server_name = server_name

    async def intercept_service(self, continuation, handler_call_details: grpc.HandlerCallDetails):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming:  # streamed uploads: no message to read an id from
            return handler
        method = handler_call_details.method.lstrip("/")
        parent = extract({k: v for k, v in handler_call_details.invocation_metadata or () if isinstance(v, str)})
        attributes = {"rpc.system": "grpc", "rpc.method": method, "tandem.server": self.server_name}

        def span(request):
            request_id = getattr(request, "request_id", "")
            extra = {REQUEST_ID_ATTRIBUTE: request_id} if request_id else {}
            return tracer().start_as_current_span(method, context=parent, kind=trace.SpanKind.SERVER,
                                                  attributes={**attributes, **extra})

        if handler.response_streaming:
            behavior = handler.unary_stream

            async def traced_stream(request, context):
                with span(request):
                    async for response in _as_async_iter(behavior(request, context)):
                        yield response

            return grpc.unary_stream_rpc_method_handler(traced_stream, handler.request_deserializer,
                                                        handler.response_serializer)
        behavior = handler.unary_unary

        async def traced_unary(request, context):
            with span(request):
                return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(traced_unary, handler.request_deserializer,
                                                   handler.response_serializer)


async def _as_async_iter(result):
    """A servicer's streaming result: an async generator, or a coroutine writing via context."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        await result
