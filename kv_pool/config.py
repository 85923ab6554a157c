"""Configuration of one pool node, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from kv_pool.eviction import Watermarks
from kv_pool.nvme_io import NVME_IO_MODES

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True)
class PoolConfig:
    """Everything one ``kv_pool`` process needs to know.

    Raises:
        ValueError: quoting the bad value, for an out-of-range port, a non-positive capacity or
            duration, watermarks outside (0, 1] or low above high, an unknown NVMe I/O, an empty
            node id, a Redis URL without a known scheme, or an advertise address that is not
            ``HOST:PORT``.
    """

    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    redis_url: str = "redis://127.0.0.1:6379/0"
    capacity_bytes: int = 2 * 1024**3  # DRAM held for blocks, reservations included
    node_id: str = "pool-0"
    advertise_address: str = ""  # what the registry tells others; "" means host:bound_port
    lease_ttl_s: float = 60.0  # lease / scoped-block lifetime when a client gives none
    metrics_port: int = 0  # Prometheus /metrics; 0 turns it off
    expiry_interval_s: float = 0.5  # how often lapsed leases are released
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    # DRAM arena file lives here (a tmpfs, so same-host workers can map it); "" = not shareable.
    arena_dir: str = "/dev/shm"
    arena_prefault: bool = False  # commit the whole arena at start (pinned-memory behaviour)
    nvme_path: str = ""  # directory of the NVMe tier's block file; "" turns the tier off
    nvme_capacity_bytes: int = 16 * 1024**3
    nvme_io: str = "os"  # how the NVMe tier reads and writes: os (pread/pwrite) or nixl (POSIX backend)
    # DRAM occupancy fractions (kv_pool.eviction): a write that would pass the high one evicts
    # (demotes, with an NVMe tier) LRU blocks until occupancy is down to the low one.
    evict_high_watermark: float = 0.95
    evict_low_watermark: float = 0.85
    put_reservation_ttl_s: float = 30.0  # a peer's ReserveBlocks not committed by then is rolled back
    # Register the arena with a NIXL (UCX) agent: on, off, auto (if importable). Off by default:
    # its progress thread costs ~0.2 core while idle, and same-host workers use shared memory.
    nixl: str = "off"

    def __post_init__(self) -> None:
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value!r}")
        for name in ("capacity_bytes", "nvme_capacity_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        self.watermarks  # validates
        if self.nvme_io not in NVME_IO_MODES:
            raise ValueError(f"nvme_io must be one of {NVME_IO_MODES}, got {self.nvme_io!r}")
        if self.nixl not in ("auto", "on", "off"):
            raise ValueError(f"nixl must be auto, on or off, got {self.nixl!r}")
        for name in ("lease_ttl_s", "expiry_interval_s", "heartbeat_interval_s", "put_reservation_ttl_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(
                f"heartbeat_ttl_s must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), "
                f"got {self.heartbeat_ttl_s!r}"
            )
        if not self.host:
            raise ValueError(f"host must not be empty, got {self.host!r}")
        if not self.node_id or ":" in self.node_id:
            raise ValueError(f"node_id must be non-empty and contain no ':', got {self.node_id!r}")
        if not self.redis_url.startswith(REDIS_SCHEMES):
            raise ValueError(f"redis_url must start with one of {REDIS_SCHEMES}, got {self.redis_url!r}")
        if self.advertise_address:
            _, sep, port = self.advertise_address.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"advertise_address must be HOST:PORT, got {self.advertise_address!r}")

    @property
    def watermarks(self) -> Watermarks:
        """The DRAM eviction watermarks. Raises ValueError (quoting the value) when invalid."""
        return Watermarks(high=self.evict_high_watermark, low=self.evict_low_watermark)
