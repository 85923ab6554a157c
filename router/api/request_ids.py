"""Request identity: the client's id for tracing, a unique id per worker attempt.

A client may name its request (OpenAI ``x-request-id`` header, gRPC ``GenerateRequest.request_id``);
that id is echoed back and carried in logs, but never used as a key inside the cluster: two
clients may send the same id, and one request may make several attempts (a prefill retry, a
decode migration). Workers, the KV pool's scoped blocks and leases only ever see
:func:`attempt_id`, unique per attempt.
"""

from __future__ import annotations

import uuid

from router.errors import as_json
from router.api.validation import InvalidRequestError

MAX_REQUEST_ID_CHARS = 128


def client_request_id(value: str | None, param: str, default_prefix: str) -> str:
    """The client's id, checked; ``default_prefix`` + 32 random hex digits when it sent none.

    Raises:
        InvalidRequestError: longer than ``MAX_REQUEST_ID_CHARS`` or not printable ASCII
            without spaces (it goes into logs and response headers as is).
    """
    if not value:
        return f"{default_prefix}{uuid.uuid4().hex}"
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"{param} has {len(value)} characters; at most {MAX_REQUEST_ID_CHARS}", param)
    if not all("!" <= c <= "~" for c in value):
        raise InvalidRequestError(f"{param} {as_json(value)} must be printable ASCII without spaces", param)
    return value


def attempt_id(client_request_id: str) -> str:
    """A worker-facing request id, unique per attempt: the client's id (for tracing) plus ``-``
    and 12 random hex digits."""
    return f"{client_request_id}-{uuid.uuid4().hex[:12]}"
