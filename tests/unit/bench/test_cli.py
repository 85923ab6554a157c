"""`tandem bench` argument handling: URLs with /v1, and runs where every request failed."""

from __future__ import annotations

import json

import pytest

from bench.cli import base_url, failure_message


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_base_url_strips_v1(url: str) -> None:
    assert base_url(url) == "http://h:8000"


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
