"""core.kv_transfer.metered: bytes, seconds and errors per backend and direction."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.kv_transfer.metered import TransferMetrics, metered


class FakeBackend(TransferBackend):
    name = "shm"

    def __init__(self, fail: bool = False):
        super().__init__(client=None)
        self.fail, self.closed = fail, False

    def read(self, keys, request_id, ttl_s, out=None):
        if self.fail:
            raise OSError("mapping failed")
        return [ReadBlock(b"x" * 100, 0) for _ in keys]

    def write(self, keys, payloads, checksums, request_id, ttl_s):
        if self.fail:
            raise OSError("pool full")
        return len(keys), 0

    def close(self):
        self.closed = True


def sample(registry: CollectorRegistry, name: str, direction: str) -> float | None:
    return registry.get_sample_value(name, {"backend": "shm", "direction": direction})


def test_counts_bytes_time_and_errors_per_direction() -> None:
    registry = CollectorRegistry()
    metrics = TransferMetrics(registry)
    backend = metered(FakeBackend(), metrics)
    assert backend.name == "shm"
    assert [b.data for b in backend.read(["a", "b", "c"], "r", 1.0)] == [b"x" * 100] * 3
    assert backend.write(["a", "b"], [b"y" * 64, memoryview(bytearray(36))], [], "w", 1.0) == (2, 0)
    assert sample(registry, "tandem:kv_transfer_bytes_total", "read") == 300
    assert sample(registry, "tandem:kv_transfer_bytes_total", "write") == 100
    assert sample(registry, "tandem:kv_transfer_seconds_total", "read") > 0
    assert sample(registry, "tandem:kv_transfer_errors_total", "read") is None  # no failure yet
    assert backend.read_views(["a"], "r", 1.0) is None  # the fake maps nothing: counted as 0 bytes
    assert sample(registry, "tandem:kv_transfer_bytes_total", "read") == 300
    backend.close()
    assert backend.inner.closed


def test_a_failed_transfer_counts_an_error_and_no_bytes() -> None:
    registry = CollectorRegistry()
    backend = metered(FakeBackend(fail=True), TransferMetrics(registry))
    with pytest.raises(OSError, match="pool full"):
        backend.write(["a"], [b"y" * 64], [], "w", 1.0)
    with pytest.raises(OSError, match="mapping failed"):
        backend.read(["a"], "r", 1.0)
    assert sample(registry, "tandem:kv_transfer_errors_total", "write") == 1
    assert sample(registry, "tandem:kv_transfer_errors_total", "read") == 1
    assert sample(registry, "tandem:kv_transfer_bytes_total", "write") is None  # no bytes counted
