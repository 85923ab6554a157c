"""Where a worker's KV pool is: the pool nodes as a consistent-hash ring, and how to reach them."""

from __future__ import annotations

import time

from core.pool_ring import HashRing
from core.registry import WorkerRegistry


class PoolLocator:
    """The KV pool nodes as a :class:`HashRing`: fixed by flag (comma-separated addresses), else
    every live pool in the registry (cached 1 s); and how to move KV bytes to them
    (``kv_transfer``: auto, grpc, shm, nixl)."""

    def __init__(self, registry: WorkerRegistry, fixed_address: str = "", kv_transfer: str = "auto"):
        self.registry = registry
        self.fixed_address = fixed_address
        self.kv_transfer = kv_transfer
        fixed = [a.strip() for a in fixed_address.split(",") if a.strip()]
        self._fixed_ring = HashRing({a: a for a in fixed}) if fixed else None
        self._cached: tuple[float, HashRing | None] = (0.0, None)

    @property
    def fixed_ring(self) -> HashRing | None:
        """The ring given by flag; None when the pool is found through the registry."""
        return self._fixed_ring

    async def ring(self) -> HashRing:
        """Raises LookupError when no pool is registered."""
        if self._fixed_ring is not None:
            return self._fixed_ring
        when, ring = self._cached
        if ring is None or time.monotonic() - when > 1.0:
            pools = await self.registry.list_workers("pool")
            if not pools:
                raise LookupError("no KV pool is registered")
            fresh = HashRing({p.worker_id: p.address for p in pools})
            ring = ring if ring == fresh else fresh
            self._cached = (time.monotonic(), ring)
        return ring
