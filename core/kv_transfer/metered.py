"""KV transfer metrics per backend: bytes, seconds and errors (docs/design.md §9b).

:class:`MeteredBackend` wraps any :class:`TransferBackend` and counts, with labels ``backend``
(grpc, shm, nixl) and ``direction`` (read: pool -> this process, write: this process -> pool):

    tandem:kv_transfer_bytes_total    block bytes moved
    tandem:kv_transfer_seconds_total  wall time of the calls (bandwidth = rate(bytes) / rate(seconds))
    tandem:kv_transfer_errors_total   calls that raised

A zero-copy ``read_views`` (shm) counts the bytes it maps as read.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import cache
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter

from core import metric_names as names
from core.block_key import BlockKey
from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.pool_client import BlockBytes

T = TypeVar("T")


class TransferMetrics:
    """The three counters in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        labels = ["backend", "direction"]
        self.bytes = Counter(names.KV_TRANSFER_BYTES, "KV block bytes moved, by backend and direction.", labels,
                             registry=registry)
        self.seconds = Counter(names.KV_TRANSFER_SECONDS, "Wall time of KV transfers, by backend and direction.",
                               labels, registry=registry)
        self.errors = Counter(names.KV_TRANSFER_ERRORS, "KV transfers that failed, by backend and direction.",
                              labels, registry=registry)

    def timed(self, backend: str, direction: str, call: Callable[[], T], num_bytes: Callable[[T], int]) -> T:
        """Runs ``call``, counting its time, ``num_bytes(result)`` or, if it raises, one error."""
        started = time.perf_counter()
        try:
            result = call()
        except Exception:
            self.errors.labels(backend, direction).inc()
            raise
        finally:
            self.seconds.labels(backend, direction).inc(time.perf_counter() - started)
        self.bytes.labels(backend, direction).inc(num_bytes(result))
        return result


@cache
def process_metrics() -> TransferMetrics:
    """The counters of this process, in prometheus_client's default registry (what a worker's
    ``--metrics-port`` serves)."""
    return TransferMetrics(REGISTRY)


def metered(backend: TransferBackend, metrics: TransferMetrics | None = None) -> TransferBackend:
    """``backend`` with its transfers counted in ``metrics`` (default: :func:`process_metrics`)."""
    return MeteredBackend(backend, metrics or process_metrics())


def _read_bytes(blocks: Sequence[ReadBlock] | None) -> int:
    return sum(len(b.data) for b in blocks or ())


class MeteredBackend(TransferBackend):
    """``inner`` with every call counted in ``metrics``; the same ``name`` and ``client``."""

    def __init__(self, inner: TransferBackend, metrics: TransferMetrics):
        super().__init__(inner.client)
        self.inner, self.metrics = inner, metrics
        self.name = inner.name

    def read(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float,
             out: memoryview | None = None) -> list[ReadBlock]:
        return self.metrics.timed(self.name, "read", lambda: self.inner.read(keys, request_id, ttl_s, out), _read_bytes)

    def read_views(self, keys: Sequence[BlockKey], request_id: str, ttl_s: float) -> list[ReadBlock] | None:
        return self.metrics.timed(self.name, "read", lambda: self.inner.read_views(keys, request_id, ttl_s),
                                  _read_bytes)

    def write(self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
              request_id: str, ttl_s: float) -> tuple[int, int]:
        num_bytes = sum(memoryview(p).nbytes for p in payloads)
        return self.metrics.timed(self.name, "write",
                                  lambda: self.inner.write(keys, payloads, checksums, request_id, ttl_s),
                                  lambda _: num_bytes)

    def close(self) -> None:
        self.inner.close()
