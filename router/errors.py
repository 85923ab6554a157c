"""The router's one error type, how each kind maps onto HTTP and gRPC, and the two failures
of a worker call that the router acts on (fail over, or prefill elsewhere).

Every failure the router reports to a client is a :class:`RouterError`; the front-ends only
translate its :class:`ErrorKind` (and the metrics count rejections by ``kind.value``).
"""

from __future__ import annotations

import enum
import json
import math
from typing import Any

import grpc


class ErrorKind(enum.Enum):
    """Why a request failed; the value is the ``reason`` label of ``tandem:rejections_total``."""

    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    SLO_UNATTAINABLE = "slo_unattainable"  # admission: no placement meets the SLOs, queues are full
    NO_WORKER = "no_worker"
    UNAVAILABLE = "unavailable"
    SHUTTING_DOWN = "shutting_down"  # the router is stopping: no new request, in-flight ones end
    # A worker's KV load from the pool failed under --kv-load-failure-policy fail: the pool or the
    # transfer broke, not the worker (not marked down, not retried); a client retry may succeed.
    KV_LOAD_FAILED = "kv_load_failed"


# kind -> (HTTP status, OpenAI error type, OpenAI error code, gRPC status code)
_TRANSPORT = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", None, grpc.StatusCode.INVALID_ARGUMENT),
    ErrorKind.MODEL_NOT_FOUND: (404, "invalid_request_error", "model_not_found", grpc.StatusCode.NOT_FOUND),
    ErrorKind.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "resource_exhausted", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorKind.SLO_UNATTAINABLE: (429, "rate_limit_error", "slo_unattainable", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ErrorKind.NO_WORKER: (503, "service_unavailable_error", "no_worker", grpc.StatusCode.UNAVAILABLE),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable_error", "unavailable", grpc.StatusCode.UNAVAILABLE),
    ErrorKind.SHUTTING_DOWN: (503, "service_unavailable_error", "shutting_down", grpc.StatusCode.UNAVAILABLE),
    ErrorKind.KV_LOAD_FAILED: (503, "service_unavailable_error", "kv_load_failed", grpc.StatusCode.UNAVAILABLE),
}


class RouterError(Exception):
    """A request failed; ``message`` says why with the real numbers, ``param`` names the field.

    ``retry_after_s`` (seconds, or None): when a retry may succeed; HTTP sends it as the
    ``Retry-After`` header, gRPC as the trailing metadata ``retry-after`` (:attr:`retry_after`).
    """

    def __init__(self, message: str, kind: ErrorKind, param: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> str | None:
        """``retry_after_s`` as Retry-After wants it: whole seconds, rounded up, at least 1."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))

    def http_headers(self) -> dict[str, str]:
        return {} if self.retry_after is None else {"Retry-After": self.retry_after}

    def grpc_trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.retry_after is None else (("retry-after", self.retry_after),)

    @property
    def http_status(self) -> int:
        return _TRANSPORT[self.kind][0]

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return _TRANSPORT[self.kind][3]

    def to_openai(self) -> dict:
        """The OpenAI error body: ``{"error": {"message", "type", "param", "code"}}``."""
        _, error_type, code, _ = _TRANSPORT[self.kind]
        return {"error": {"message": self.message, "type": error_type, "param": self.param, "code": code}}


class WorkerFailedError(RouterError):
    """The worker broke (died, reset the connection, ended a stream early), not the request:
    the caller marks it down and may retry the request elsewhere."""

    def __init__(self, message: str, address: str):
        super().__init__(message, ErrorKind.UNAVAILABLE)
        self.address = address


class KVSaveFailedError(RouterError):
    """A prefill worker could not write the prompt's KV to the pool (the pool broke, not the
    worker): the caller prefills on the decode worker instead and marks nobody down."""

    def __init__(self, message: str, address: str):
        super().__init__(message, ErrorKind.UNAVAILABLE)
        self.address = address


def as_json(value: Any) -> str:
    """``value`` as JSON text, the way the client sent it (``true``, ``null``, ``"text"``,
    ``{"type": "json_object"}``), for error messages that quote it. A lone surrogate in a string
    comes out escaped (``\\ud800``): the error body must encode as UTF-8."""
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def kind_from_grpc(code: grpc.StatusCode) -> ErrorKind:
    """How a worker's gRPC status reaches the client: bad input stays bad input, overload stays
    overload, everything else means the cluster could not serve the request."""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ErrorKind.INVALID_REQUEST
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ErrorKind.RESOURCE_EXHAUSTED
    return ErrorKind.UNAVAILABLE
