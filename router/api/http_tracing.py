"""A span per HTTP request of the router while tracing is on (core.tracing): the child of the
client's W3C ``traceparent`` header when it sends one, named ``METHOD PATH``, with the status
and the request id the router answered (``x-request-id``). Worker RPCs made while it is current
carry it on (core.grpc_auth), so the trace runs router → prefill → pool → decode."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.propagate import extract
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core import tracing


class TracingMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not tracing.enabled():
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        name = f"{scope['method']} {scope['path']}"
        attributes = {"http.request.method": scope["method"], "url.path": scope["path"]}
        with tracing.tracer().start_as_current_span(name, context=extract(headers), kind=trace.SpanKind.SERVER,
                                                    attributes=attributes) as span:
            async def send_traced(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", message["status"])
                    for key, value in message.get("headers", ()):
                        if key == b"x-request-id":
                            span.set_attribute(tracing.REQUEST_ID_ATTRIBUTE, value.decode("latin-1"))
                await send(message)

            await self.app(scope, receive, send_traced)
