"""router_sees: a router counts as started only once its /health answers 200 with every worker
the cluster starts (a real HTTP server on a free port; no router)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from launcher.readiness import router_sees


@pytest.fixture
def health():
    """A /health server whose (status, body) the test sets; yields (url, setter)."""
    state = {"reply": (503, b"{}")}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            status, body = state["reply"]
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def set_reply(status: int, workers: dict | None = None, raw: bytes | None = None) -> None:
        state["reply"] = (status, raw if raw is not None else json.dumps({"workers": workers or {}}).encode())

    yield f"http://127.0.0.1:{server.server_address[1]}/health", set_reply
    server.shutdown()
    server.server_close()


def test_ready_only_with_every_worker_seen(health) -> None:
    url, reply = health
    check = router_sees(url, num_prefill=1, num_decode=2)
    reply(503, {"prefill": 1, "decode": 0})  # no decode worker seen yet: unhealthy
    assert not check()
    reply(200, {"prefill": 0, "decode": 2})  # healthy (decode workers prefill), one worker short
    assert not check()
    reply(200, {"prefill": 1, "decode": 1})
    assert not check()
    reply(200, {"prefill": 1, "decode": 2, "pool": 1})
    assert check()
    reply(200, raw=b"not json")
    assert not check()


def test_no_server_is_not_ready() -> None:
    assert not router_sees("http://127.0.0.1:9/health", 0, 1)()
