"""A worker process's own settings (the engine's are engine.config.EngineConfig). Torch-free:
the launcher composes its cluster configuration of it."""

from __future__ import annotations

from dataclasses import dataclass

from core.kv_transfer.select import TRANSFER_MODES
from core.registry import DEFAULT_REDIS_URL
from core.settings import setting

# engine.kv_connector.KVLoadFailurePolicy's values (a test keeps them equal), named here without
# importing the connector, which imports torch.
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


@dataclass(frozen=True)
class WorkerConfig:
    """Process-level settings of a prefill or decode worker; each field's default and help text
    are the workers' ``--flag`` (core.settings).

    Raises:
        ValueError: quoting the offending value.
    """

    host: str = setting("127.0.0.1", "Interface to bind.")
    port: int = setting(0, "gRPC port; 0 picks a free one.")  # each role's command sets its own default
    redis_url: str = setting(DEFAULT_REDIS_URL, "Control-plane Redis (registry, heartbeats).")
    pool_address: str = setting("", "KV pool host:port, comma-separated for several nodes (default: found in "
                                    "Redis).")
    worker_id: str = setting("", "Default: <role>-<hostname>-<pid>.")
    advertise_address: str = setting("", "Address others dial (default: host:port).")
    metrics_port: int = setting(0, "Prometheus port (0: off).")
    # How KV bytes reach the pool (core.kv_transfer.select).
    kv_transfer: str = setting("auto", "How the worker moves KV to and from the pool; auto: shm on the pool's "
                                       "host, else nixl, else grpc.", choices=TRANSFER_MODES)
    # A failed KV load from the pool: recompute or fail the request (engine.kv_connector.load_failure).
    kv_load_failure_policy: str = setting(
        "recompute", "A KV load from the pool that fails (unreachable, transfer error, checksum, lost lease): "
                     "recompute the KV here, or fail the request (gRPC UNAVAILABLE, HTTP 503). Counted in "
                     "tandem:kv_load_failures_total.", choices=KV_LOAD_FAILURE_POLICIES)
    # Deadline of the pool leases this worker takes (docs/design.md §5): the pool frees what a
    # worker that died or hung, or a manifest the router never delivered, still holds this long after.
    kv_lease_ttl_s: float = setting(
        60.0, "Deadline (s) of the pool leases this worker takes on the KV blocks it writes and reads: what a worker "
              "that dies or hangs (or a manifest never delivered) holds is freed by the pool this long after; reads "
              "running longer renew theirs.")
    # Synthetic passes timed at start-up so the cost model is fitted before traffic (0: none).
    calibration_steps: int = setting(16, "Synthetic passes timed at start-up to fit the cost model (0: off; at "
                                         "most ~5 s).")
    # Core sharing on one machine (engine.core_share): the launcher gives every worker of the
    # machine the same directory; a decode worker adds core_share_threads while prefill is idle.
    core_share_dir: str = setting("", "Directory of the lock files by which the prefill and decode workers of one "
                                      "machine take turns on the prefill workers' cores (empty: off).")
    core_share_threads: int = setting(0, "Decode worker: threads it adds while it runs on idle prefill workers' "
                                         "cores (with --core-share-dir).")
    log_level: str = setting("INFO", "Log level.", choices=LOG_LEVELS)
    heartbeat_interval_s: float = setting(1.0, option=False)
    heartbeat_ttl_s: float = setting(3.0, option=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.kv_transfer not in TRANSFER_MODES:
            raise ValueError(f"kv_transfer must be one of {TRANSFER_MODES}, got {self.kv_transfer!r}")
        if self.kv_load_failure_policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, "
                             f"got {self.kv_load_failure_policy!r}")
        if not self.kv_lease_ttl_s > 0:
            raise ValueError(f"kv_lease_ttl_s must be > 0, got {self.kv_lease_ttl_s!r}")
        if self.calibration_steps < 0:
            raise ValueError(f"calibration_steps must be >= 0, got {self.calibration_steps}")
        if self.core_share_threads < 0:
            raise ValueError(f"core_share_threads must be >= 0, got {self.core_share_threads}")
        if self.log_level.upper() not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if self.heartbeat_ttl_s <= self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_ttl_s must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), "
                             f"got {self.heartbeat_ttl_s}")
