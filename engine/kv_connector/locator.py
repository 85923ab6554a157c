"""Where a worker's KV pool is: the pool nodes as a consistent-hash ring, and how to reach them.

Found through the registry (no ``--pool-address``: the Helm chart's way), the ring is read from
Redis once and then refreshed in the background at most every ``REFRESH_S``: a KV load never waits
on Redis once a ring is known, and a refresh that fails or finds no pool node keeps the ring it
had (a worker or pool node cut off from Redis keeps moving KV to the nodes it knew; a node that
really left fails its transfers, which the KV-load policy handles). Before, a worker cut off from
Redis waited out the Redis client's 5 s timeout in every KV load after the 1 s cache expired, and
its Prefill then failed ``UNKNOWN`` with the Redis error, so the router marked it down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from core.pool_ring import HashRing
from core.registry import WorkerRegistry

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # a known ring is re-read from the registry at most this often, in the background


class PoolLocator:
    """The KV pool nodes as a :class:`HashRing`: fixed by flag (comma-separated addresses), else
    every live pool in the registry (see the module docstring); and how to move KV bytes to them
    (``kv_transfer``: auto, grpc, shm, nixl). ``clock``: monotonic seconds. Not thread-safe (the
    worker's event loop is its only user)."""

    def __init__(self, registry: WorkerRegistry, fixed_address: str = "", kv_transfer: str = "auto",
                 clock: Callable[[], float] = time.monotonic):
        self.registry = registry
        self.fixed_address = fixed_address
        self.kv_transfer = kv_transfer
        self.clock = clock
        fixed = [a.strip() for a in fixed_address.split(",") if a.strip()]
        self._fixed_ring = HashRing({a: a for a in fixed}) if fixed else None
        self._cached: tuple[float, HashRing | None] = (0.0, None)
        self._refreshing: asyncio.Task | None = None
        self._stale = False  # the last refresh failed (logged once until one succeeds)

    @property
    def fixed_ring(self) -> HashRing | None:
        """The ring given by flag; None when the pool is found through the registry."""
        return self._fixed_ring

    async def ring(self) -> HashRing:
        """The pool nodes: the flag's, or the registry's as last read (a refresh started in the
        background when older than REFRESH_S). Mutates: the cached ring.

        Raises:
            LookupError: no ring known yet and the registry lists no pool node or cannot be read.
        """
        if self._fixed_ring is not None:
            return self._fixed_ring
        when, ring = self._cached
        if ring is None:
            return await self._read()
        if self.clock() - when > REFRESH_S and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh())
        return ring

    async def _read(self) -> HashRing:
        """Reads the pool nodes from the registry. Mutates: the cached ring (kept when equal).
        Raises LookupError: none registered, or the registry cannot be read."""
        try:
            pools = await self.registry.list_workers("pool")
        except Exception as err:  # redis connection or timeout errors
            raise LookupError(f"cannot read the KV pool nodes from the registry: {type(err).__name__}: {err}") from err
        if not pools:
            raise LookupError("no KV pool is registered")
        fresh = HashRing({p.worker_id: p.address for p in pools})
        ring = self._cached[1]
        ring = ring if ring == fresh else fresh
        self._cached = (self.clock(), ring)
        return ring

    async def _refresh(self) -> None:
        """One background re-read; on failure the known ring stays (logged once per outage)."""
        try:
            await self._read()
        except LookupError as err:
            self._cached = (self.clock(), self._cached[1])  # next try after REFRESH_S
            if not self._stale:
                log.warning("%s; keeping the %d pool node(s) known", err, len(self._cached[1].nodes))
            self._stale = True
            return
        if self._stale:
            log.info("the KV pool nodes are readable from the registry again")
        self._stale = False
