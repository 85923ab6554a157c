"""PoolConfig validation quotes the bad value."""

from __future__ import annotations

import pytest

from kv_pool.config import PoolConfig


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"port": 70000}, "port must be in \\[0, 65535\\], got 70000"),
        ({"capacity_bytes": 0}, "capacity_bytes must be > 0, got 0"),
        ({"lease_ttl_s": -1.0}, "lease_ttl_s must be > 0, got -1.0"),
        ({"node_id": ""}, "node_id must be non-empty"),
        ({"redis_url": "http://x"}, "'http://x'"),
        ({"advertise_address": "pool-0"}, "HOST:PORT, got 'pool-0'"),
        ({"heartbeat_ttl_s": 1.0}, "heartbeat_ttl_s must exceed"),
        ({"nvme_capacity_bytes": -1}, "nvme_capacity_bytes must be > 0, got -1"),
        ({"nixl": "maybe"}, "nixl must be auto, on or off, got 'maybe'"),
        ({"put_reservation_ttl_s": 0.0}, "put_reservation_ttl_s must be > 0, got 0.0"),
        ({"nvme_io": "spdk"}, "nvme_io must be one of \\('os', 'nixl'\\), got 'spdk'"),
        ({"evict_low_watermark": 0.99}, "low watermark 0.99 must not exceed the high watermark 0.95"),
    ],
)
def test_bad_values_are_rejected(overrides, message):
    with pytest.raises(ValueError, match=message):
        PoolConfig(**overrides)


def test_defaults_and_port_zero_are_valid():
    assert PoolConfig(port=0, advertise_address="pool.svc:50051").capacity_bytes == 2 * 1024**3
