"""`tandem bench` argument handling: URLs with /v1, runs where every request failed, and what it
says when the server is down or lists no model."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
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
def http_server() -> Iterator:
    """``start(answer)`` -> the URL of a server answering every GET with ``answer(headers)``
    -> (status, body); every server is stopped at the end of the test."""
    servers = []

    def start(answer) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                status, body = answer(self.headers)
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


@pytest.fixture
def models_server(http_server) -> Callable[[int, bytes], str]:
    """``start(status, body)`` -> the URL of a server answering every GET with them."""
    return lambda status, body: http_server(lambda headers: (status, body))


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


@pytest.fixture
def keyed_server(http_server) -> Callable[[str], str]:
    """``start(key)`` -> the URL of a server that lists model m1 to ``Authorization: Bearer <key>``
    and answers 401 otherwise (POST: 501, nothing is served)."""

    def answer(key: str, headers) -> tuple[int, bytes]:
        if headers.get("authorization") == f"Bearer {key}":
            return 200, b'{"data": [{"id": "m1"}]}'
        return 401, b'{"error": {"message": "invalid API key"}}'

    return lambda key: http_server(lambda headers: answer(key, headers))


def test_a_server_wanting_an_api_key_is_told_so_not_asked_for_a_model(keyed_server) -> None:
    url = keyed_server("sk-1")
    with pytest.raises(click.ClickException) as info:
        served_model(url)
    assert info.value.message == (f"{url}/v1/models answered HTTP 401: the server wants an API key; pass --api-key KEY "
                                  "(or set TANDEM_API_KEY)")
    with pytest.raises(click.ClickException) as info:
        served_model(url, api_key="sk-wrong")
    assert "the server refused the API key; pass --api-key KEY" in info.value.message
    assert served_model(url, api_key="sk-1") == "m1"


@pytest.mark.parametrize("how", ["flag", "env"])
def test_bench_sends_the_api_key(keyed_server, tmp_path, monkeypatch, how: str) -> None:
    """With the key the model list is read (then the fake server fails every POST with 501)."""
    url = keyed_server("sk-1")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "no-data"))
    args = ["--url", url, "--roofline-model", "", "--no-progress", "--num-requests", "2", "--output-dir",
            str(tmp_path / "out")]
    if how == "flag":
        args += ["--api-key", "sk-1"]
    else:
        monkeypatch.setenv("TANDEM_API_KEY", "sk-1 sk-2")  # the first of several
    result = CliRunner().invoke(bench, args, terminal_width=400)
    assert result.exit_code == 1
    assert "Error: all 2 requests failed; the first (http_501)" in result.output  # (the server's HTML follows)
    assert json.loads((tmp_path / "out" / "run.json").read_text())["settings"]["model"] == "m1"


def test_requests_refused_for_want_of_a_key_say_which_flag_sends_one() -> None:
    body = json.dumps({"error": {"message": "missing API key"}})
    assert failure_message([record("http_401", body)]) == (
        "all 1 requests failed; the first (http_401): missing API key; pass --api-key KEY (or set TANDEM_API_KEY)")


def test_a_trace_workload_without_a_file_names_where_to_get_it(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    result = CliRunner().invoke(bench, ["--workload", "azure", "--model", "m"], terminal_width=1000)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1].startswith(
        "Error: --workload azure needs --path FILE; get the Azure LLM inference trace 2023, conversation (19,366 "
        "requests): https://raw.githubusercontent.com/Azure/AzurePublicDataset/")


def test_without_url_bench_loads_the_cluster_tandem_up_runs_here(keyed_server, tmp_path, monkeypatch) -> None:
    from core import cluster_record

    url = keyed_server("sk-1")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path / "no-data"))
    cluster_record.write([url], tmp_path / "logs")
    result = CliRunner().invoke(bench, ["--api-key", "sk-1", "--roofline-model", "", "--no-progress", "--num-requests",
                                        "1", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 1  # the fake server serves no completion
    assert json.loads((tmp_path / "out" / "run.json").read_text())["settings"]["url"] == url
