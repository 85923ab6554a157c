"""What a worker does when loading KV from the pool fails (``--kv-load-failure-policy``).

A load fails when the pool cannot be reached, a transfer errs or is cut short, a block fails
its checksum, the read's lease was lost (:mod:`engine.kv_connector.lease_keeper`), or blocks a
manifest names are gone. Whatever the policy, the failure is counted in
``tandem:kv_load_failures_total{stage, reason, action}`` and logged, and no byte of the failed
read reaches the model:

- ``recompute`` (default): the worker computes the KV itself (the prefill worker ignores the
  prefix hit and prefills the whole prompt; the decode worker prefills the prompt locally
  instead of loading the manifest). Greedy output is unchanged, only slower.
- ``fail``: the request ends with :class:`KVLoadError`, which the servicers send as gRPC
  ``UNAVAILABLE`` with trailing metadata ``tandem-kv-load-failure: <reason>`` (the router
  answers HTTP 503 ``kv_load_failed`` and neither retries nor marks the worker down: the worker
  is fine, the pool or the transfer is not, and a retry by the client may well succeed).
"""

from __future__ import annotations

import enum
import logging
from functools import cache

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from core import metric_names as names
from core.failure_metadata import KV_LOAD_FAILURE_KEY

log = logging.getLogger(__name__)

# Trailing metadata key of a request ended by the ``fail`` policy; its value is the reason.
METADATA_KEY = KV_LOAD_FAILURE_KEY  # core.failure_metadata

# Why a load failed (the ``reason`` label).
UNREACHABLE = "unreachable"  # the pool node did not answer (UNAVAILABLE, DEADLINE_EXCEEDED, OSError, none registered)
TRANSFER_ERROR = "transfer_error"  # the pool answered another error
TRUNCATED = "truncated"  # a block arrived incomplete
CHECKSUM = "checksum"  # a block's bytes do not match the writer's checksum
LEASE_LOST = "lease_lost"  # the read outlived its lease
MISSING = "missing"  # blocks a manifest names are not in the pool any more
REASONS = (UNREACHABLE, TRANSFER_ERROR, TRUNCATED, CHECKSUM, LEASE_LOST, MISSING)
STAGES = ("prefix", "manifest", "resume")  # prefill's prefix hit, decode's manifest, a resumed request


class KVLoadFailurePolicy(enum.Enum):
    RECOMPUTE = "recompute"
    FAIL = "fail"


class KVLoadError(Exception):
    """A KV load from the pool failed; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"KV load failed ({reason}): {message}")
        self.reason = reason

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((METADATA_KEY, self.reason),)


def reason_of(err: grpc.RpcError | OSError) -> str:
    """The reason label of a pool call that raised."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code = err.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return UNREACHABLE
        return MISSING if code == grpc.StatusCode.NOT_FOUND else TRANSFER_ERROR
    return UNREACHABLE


class KVLoadFailures:
    """Applies the policy: counts and logs each failure, raises under ``fail``."""

    def __init__(self, policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE,
                 counter: Counter | None = None):
        self.policy = policy
        self.counter = counter if counter is not None else process_counter()

    def failed(self, stage: str, err: KVLoadError, request_id: str) -> None:
        """Counts ``err`` at ``stage``; returns under ``recompute``.

        Raises:
            KVLoadError: ``err`` itself, under ``fail``.
        """
        action = self.policy.value
        self.counter.labels(stage, err.reason, action).inc()
        log.warning("%s (stage %s); policy %s", err, stage, action, extra={"request_id": request_id})
        if self.policy is KVLoadFailurePolicy.FAIL:
            raise err


def make_counter(registry: CollectorRegistry) -> Counter:
    return Counter(names.KV_LOAD_FAILURES, "KV loads from the pool that failed, by stage, reason and the "
                   "policy's action (recompute or fail).", ["stage", "reason", "action"], registry=registry)


@cache
def process_counter() -> Counter:
    """The counter of this process, in prometheus_client's default registry (a worker's /metrics)."""
    return make_counter(REGISTRY)
