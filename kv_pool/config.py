"""Configuration of one pool node, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from core.registry import DEFAULT_REDIS_URL
from core.settings import setting
from kv_pool.eviction import Watermarks
from kv_pool.nvme_io import NVME_IO_MODES

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
NIXL_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class PoolConfig:
    """Everything one ``kv_pool`` process needs to know; each field's default and help text are
    ``python -m kv_pool``'s ``--flag`` (and ``tandem up``'s ``--pool-<flag>``; core.settings).

    Raises:
        ValueError: quoting the bad value, for an out-of-range port, a non-positive capacity or
            duration, watermarks outside (0, 1] or low above high, an unknown NVMe I/O, an empty
            node id, a Redis URL without a known scheme, or an advertise address that is not
            ``HOST:PORT``.
    """

    host: str = setting("127.0.0.1", "Interface to bind.")
    port: int = setting(50051, "gRPC port; 0 picks a free one (logged).")
    redis_url: str = setting(DEFAULT_REDIS_URL, "Control-plane Redis.")
    # DRAM held for blocks, reservations included.
    capacity_bytes: int = setting(2 * 1024**3, "KV pool DRAM capacity: bytes or a size such as 512MiB, 2GiB.",
                                  byte_size=True)
    node_id: str = setting("pool-0", "Registry id and index value of this node.")
    advertise_address: str = setting("", "HOST:PORT others dial; default host:bound port.")
    lease_ttl_s: float = setting(60.0, "Lifetime of a lease or request-scoped block without an explicit one.")
    metrics_port: int = setting(0, "Prometheus /metrics port; 0 turns it off.")
    expiry_interval_s: float = setting(0.5, "How often lapsed leases are released.")
    heartbeat_interval_s: float = setting(1.0, option=False)
    heartbeat_ttl_s: float = setting(3.0, option=False)
    # The DRAM arena file lives here (a tmpfs, so same-host workers can map it); "" = not shareable.
    arena_dir: str = setting("/dev/shm", "Directory (a tmpfs) of the shared-memory DRAM arena file; '' keeps it "
                                         "private.")
    arena_prefault: bool = setting(False, "Commit every arena page at start (first writes are then ~10x faster; "
                                          "costs the memory now; pinned-memory behaviour).")
    nvme_path: str = setting("", "Directory of the NVMe tier's block file; '' turns the tier off.")
    nvme_capacity_bytes: int = setting(16 * 1024**3, "Bytes of the NVMe tier.", byte_size=True)
    nvme_io: str = setting("os", "NVMe tier I/O: os (pread/pwrite) or nixl (NIXL's POSIX backend; needs the nixl "
                                 "package).", choices=NVME_IO_MODES)
    # DRAM occupancy fractions (kv_pool.eviction): a write that would pass the high one evicts
    # (demotes, with an NVMe tier) LRU blocks until occupancy is down to the low one.
    evict_high_watermark: float = setting(0.95, "DRAM occupancy (fraction) past which LRU blocks are evicted "
                                                "(demoted to NVMe) ...")
    evict_low_watermark: float = setting(0.85, "... down to this occupancy (fraction).")
    put_reservation_ttl_s: float = setting(30.0, "A peer's reserved, uncommitted blocks are rolled back after this "
                                                 "long.")
    # Register the arena with a NIXL (UCX) agent: on, off, auto (if importable). Off by default:
    # its progress thread costs ~0.2 core while idle, and same-host workers use shared memory.
    nixl: str = setting("off", "Register the arena with a NIXL (UCX) agent for one-sided peer transfers.",
                        choices=NIXL_MODES)

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
        if self.nixl not in NIXL_MODES:
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
