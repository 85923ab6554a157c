"""``python -m kv_pool``: run one KV pool node. Every flag can also come from ``TANDEM_POOL_<FLAG>``."""

from __future__ import annotations

import asyncio
import logging
import sys

import click

from core.logging_setup import setup_logging
from kv_pool.config import PoolConfig
from kv_pool.server import serve

_DEFAULTS = PoolConfig()


def _option(flag: str, **kwargs):
    envvar = "TANDEM_POOL_" + flag.lstrip("-").replace("-", "_").upper()
    return click.option(flag, envvar=envvar, show_envvar=True, show_default=True, **kwargs)


@click.command()
@_option("--host", default=_DEFAULTS.host, help="Interface to bind.")
@_option("--port", type=int, default=_DEFAULTS.port, help="gRPC port; 0 picks a free one (logged).")
@_option("--redis-url", default=_DEFAULTS.redis_url, help="Control-plane Redis.")
@_option("--capacity-bytes", type=int, default=_DEFAULTS.capacity_bytes, help="DRAM for blocks.")
@_option("--node-id", default=_DEFAULTS.node_id, help="Registry id and index value of this node.")
@_option("--advertise-address", default="", help="HOST:PORT others dial; default host:bound port.")
@_option("--lease-ttl-s", type=float, default=_DEFAULTS.lease_ttl_s, help="Lease lifetime when a client gives none.")
@_option("--arena-dir", default=_DEFAULTS.arena_dir,
         help="Directory (a tmpfs) of the shared-memory DRAM arena file; '' keeps it private.")
@_option("--arena-prefault/--no-arena-prefault", default=False,
         help="Commit every arena page at start (first writes are then ~10x faster; costs the memory now).")
@_option("--nvme-path", default="", help="Directory of the NVMe tier's block file; '' turns the tier off.")
@_option("--nvme-capacity-bytes", type=int, default=_DEFAULTS.nvme_capacity_bytes, help="Bytes of the NVMe tier.")
@_option("--nvme-io", default=_DEFAULTS.nvme_io, type=click.Choice(["os", "nixl"]),
         help="NVMe tier I/O: os (pread/pwrite) or nixl (NIXL's POSIX backend; needs the nixl package).")
@_option("--evict-high-watermark", type=float, default=_DEFAULTS.evict_high_watermark,
         help="DRAM occupancy (fraction) past which LRU blocks are evicted (demoted to NVMe) ...")
@_option("--evict-low-watermark", type=float, default=_DEFAULTS.evict_low_watermark,
         help="... down to this occupancy (fraction).")
@_option("--put-reservation-ttl-s", type=float, default=_DEFAULTS.put_reservation_ttl_s,
         help="A peer's reserved, uncommitted blocks are rolled back after this long.")
@_option("--nixl", default=_DEFAULTS.nixl, type=click.Choice(["auto", "on", "off"]),
         help="Register the arena with a NIXL (UCX) agent for one-sided peer transfers.")
@_option("--metrics-port", type=int, default=0, help="Prometheus /metrics port; 0 turns it off.")
@_option("--log-level", default="INFO", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False))
def main(log_level: str, **flags) -> None:
    """Run one KV pool node (docs/design.md §4-§6) until SIGTERM."""
    try:
        config = PoolConfig(**flags)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    setup_logging("kv_pool", log_level)
    try:
        asyncio.run(serve(config))
    except Exception:  # e.g. Redis unreachable, port taken: say why as a JSON line
        logging.getLogger("kv_pool").exception("kv_pool failed")
        sys.exit(1)


if __name__ == "__main__":
    main()
