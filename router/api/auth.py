"""API keys on the router's public APIs (HTTP here; gRPC: core.grpc_auth.api_key_gate).

A client sends ``Authorization: Bearer <key>`` (the official ``openai`` client does, from its
``api_key``); any of the configured keys is accepted. Without a valid one the HTTP API answers
OpenAI's 401 (``{"error": {"type": "invalid_request_error", "code": "invalid_api_key"}}``,
``WWW-Authenticate: Bearer``) and the request touches nothing else. Paths in ``open_paths``
(``/health`` and ``/metrics`` by default: probes and Prometheus send no key) stay open.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from core.grpc_auth import bearer_token, token_matches
from router.config import DEFAULT_OPEN_PATHS
from router.api.http_errors import openai_error


def load_api_keys(keys: Iterable[str], key_file: str = "") -> tuple[str, ...]:
    """The accepted keys: ``keys`` (each may hold several, comma- or whitespace-separated, as an
    environment variable does) plus one key per non-empty, non-``#`` line of ``key_file``.

    Raises:
        ValueError: ``key_file`` cannot be read, or names no key.
    """
    found = [part for key in keys for part in key.replace(",", " ").split()]
    if key_file:
        try:
            lines = Path(key_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"api_key_file: cannot read {key_file!r}: {err.strerror}") from err
        from_file = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        if not from_file:
            raise ValueError(f"api_key_file {key_file!r} holds no key")
        found += from_file
    return tuple(dict.fromkeys(found))


class ApiKeyMiddleware:
    """Answers 401 to an HTTP request outside ``open_paths`` without one of ``api_keys``."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], open_paths: Sequence[str] = DEFAULT_OPEN_PATHS):
        self.app, self.api_keys, self.open_paths = app, tuple(api_keys), frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        if token_matches(bearer_token(header), self.api_keys):
            await self.app(scope, receive, send)
            return
        message = ("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'." if not header
                   else "Incorrect API key provided.")
        response = openai_error(401, message, "invalid_request_error", "invalid_api_key",
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)
