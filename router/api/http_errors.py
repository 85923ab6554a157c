"""HTTP-level failures (unknown path, wrong method, unreadable or oversized body) in OpenAI's
error format, so every error a client of the OpenAI API sees has the same shape."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_BODY_BYTES = 16 * 1024 * 1024  # 16 MiB: far above any prompt that fits a context
ROUTES = ("/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize, /version, /ping, /health, "
          "/metrics")


def openai_error(status: int, message: str, error_type: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": {"message", "type", "param", "code"}}`` with ``status``."""
    body = {"error": {"message": message, "type": error_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def http_exception_response(request: Request, err: HTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own HTTP errors, rewritten with a message a client can act on."""
    where = f"{request.method} {request.url.path}"
    if err.status_code == 404:
        return openai_error(404, f"no such endpoint: {where}; this server serves {ROUTES}", code="not_found")
    if err.status_code == 405:
        return openai_error(405, f"method not allowed: {where}", code="method_not_allowed", headers=err.headers)
    if err.status_code == 413:
        return openai_error(413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes",
                            code="request_too_large")
    if err.status_code == 400 and isinstance(err.__cause__, UnicodeDecodeError):
        cause = err.__cause__
        return openai_error(400, f"the request body is not valid UTF-8 (byte 0x{cause.object[cause.start]:02x} "
                                 f"at offset {cause.start})")
    error_type = "invalid_request_error" if err.status_code < 500 else "server_error"
    return openai_error(err.status_code, str(err.detail), error_type, headers=err.headers)


class BodyLimitMiddleware:
    """Refuses a request body over ``max_body_bytes`` with 413 without reading it whole: at once
    when its Content-Length says so, else as soon as the bytes received pass the limit (the
    HTTPException raised from ``receive`` reaches :func:`http_exception_response`)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await openai_error(413, f"the request body is over the limit of {self.max_body_bytes} bytes",
                               code="request_too_large")(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise HTTPException(413)
            return message

        await self.app(scope, counting_receive, send)
