"""`tandem bench` argument handling: URLs with /v1, runs where every request failed, and what it
says when the server is down or lists no model."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bench.cli import base_url, bench, failure_message, served_model, workload_label
from tests.conftest import find_free_port


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_base_url_strips_v1(url: str) -> None:
    assert base_url(url) == "http://h:8000"


def test_workload_label_says_what_the_requests_came_from() -> None:
    assert workload_label("sharegpt", None) == "built-in prompts"  # --workload's default, but no file
    assert workload_label("sharegpt", Path("sharegpt.json")) == "sharegpt"
    assert workload_label("mooncake", Path("trace.jsonl")) == "mooncake"


def record(error_kind: str = "", error: str = "") -> dict:
    return {"error_kind": error_kind, "error": error}


def test_failure_message_quotes_the_servers_error() -> None:
    body = json.dumps({"error": {"message": 'model "foo" does not exist', "type": "invalid_request_error"}})
    assert failure_message([record("http_404", body), record("http_404", body)]) == (
        'all 2 requests failed; the first (http_404): model "foo" does not exist')
    stream_error = json.dumps({"message": "decode worker failed", "type": "service_unavailable_error"})
    assert failure_message([record("stream_error", stream_error)]) == (
        "all 1 requests failed; the first (stream_error): decode worker failed")
    assert failure_message([record("ConnectError", "All connection attempts failed")]) == (
        "all 1 requests failed; the first (ConnectError): All connection attempts failed")


def test_no_failure_message_when_one_request_succeeded() -> None:
    assert failure_message([record("http_503", "{}"), record()]) is None
    assert failure_message([]) is None


@pytest.fixture
def models_server() -> Iterator:
    """``start(status, body)`` -> the URL of a server answering every GET with them."""
    servers = []

    def start(status: int, body: bytes) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                self.send_response(status)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_bench(url: str) -> tuple[int, str]:
    result = CliRunner().invoke(bench, ["--url", f"{url}/v1", "--roofline-model", "", "--no-progress"])
    return result.exit_code, result.output.splitlines()[-1]


def test_a_server_that_is_down_is_not_asked_for_a_model() -> None:
    url = f"http://127.0.0.1:{find_free_port()}"  # nothing listens there
    assert run_bench(url) == (
        1, f"Error: nothing answers at {url} ([Errno 111] Connection refused); is the server up, and --url right?")


def test_a_server_that_never_replies_times_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(click.ClickException) as info:
            served_model(url, timeout_s=0.2)
    assert info.value.message == (
        f"nothing answers at {url} (no reply within 0.2 s); is the server up, and --url right?")


def test_a_server_listing_no_model_asks_for_model(models_server) -> None:
    url = models_server(200, b'{"object": "list", "data": []}')
    assert run_bench(url) == (1, f"Error: {url}/v1/models lists no model; pass --model")


@pytest.mark.parametrize(("status", "body", "message"), [
    (404, b"not found", "{url}/v1/models answered HTTP 404, not a model list; pass --model"),
    (200, b"<html></html>", "{url}/v1/models lists no model; pass --model"),
    (200, b'["m"]', "{url}/v1/models lists no model; pass --model"),
])
def test_a_server_without_a_model_list(models_server, status: int, body: bytes, message: str) -> None:
    url = models_server(status, body)
    with pytest.raises(click.ClickException) as info:
        served_model(url)
    assert info.value.message == message.format(url=url)


def test_the_first_listed_model_is_used(models_server) -> None:
    url = models_server(200, b'{"object": "list", "data": [{"id": "m1"}, {"id": "m2"}]}')
    assert served_model(url) == "m1"
