"""One pool node as a process: block store, gRPC, Redis index mirror, registry, lease expiry."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket

from core.grpc_service import GrpcService, run_until_signalled
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry
from kv_pool.block_store import BlockStore
from kv_pool.config import PoolConfig
from kv_pool.index_mirror import IndexMirror
from kv_pool.metrics import PoolMetrics
from kv_pool.servicer import SERVICE_NAME, KVPoolServicer
from tandem.v1 import kv_pool_pb2_grpc

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


class PoolServer:
    """Wires the pool's parts together; construct it inside the event loop that runs it."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self._registry = WorkerRegistry(config.redis_url)
        self._mirror = IndexMirror(self._registry.redis, config.node_id)
        self.store = BlockStore(config.capacity_bytes, config.lease_ttl_s, on_event=self._mirror.report)
        self._metrics = PoolMetrics(self.store.stats)
        self._grpc = GrpcService(config.host, config.port, [SERVICE_NAME])
        servicer = KVPoolServicer(self.store, self._metrics, config.lease_ttl_s)
        kv_pool_pb2_grpc.add_KVPoolServicer_to_server(servicer, self._grpc.server)
        self._heartbeat: Heartbeat | None = None
        self._expiry_task: asyncio.Task | None = None
        self.address = ""

    async def start(self) -> None:
        """Clears stale index entries, serves gRPC, registers as role "pool", starts expiry.

        Raises:
            redis.exceptions.ConnectionError: Redis is unreachable.
            RuntimeError: the gRPC port cannot be bound.
            OSError: the metrics port cannot be bound.
        """
        await self._mirror.start()
        port = await self._grpc.start()
        self.address = self.config.advertise_address or f"{self._advertise_host()}:{port}"
        info = WorkerInfo(worker_id=self.config.node_id, role="pool", address=self.address)
        self._heartbeat = Heartbeat(
            self._registry, info, self._load, self.config.heartbeat_interval_s, self.config.heartbeat_ttl_s
        )
        await self._heartbeat.start()
        self._expiry_task = asyncio.create_task(self._expire_forever(), name="kv-pool-lease-expiry")
        if self.config.metrics_port:
            self._metrics.serve(self.config.metrics_port, self.config.host)
        log.info(
            "kv_pool %s listening on %s:%d (advertised %s), capacity %d bytes, metrics port %d",
            self.config.node_id, self.config.host, port, self.address,
            self.config.capacity_bytes, self.config.metrics_port,
            extra={"worker_id": self.config.node_id},
        )

    async def stop(self) -> None:
        """Deregisters first (routers stop sending), drains gRPC, then removes index entries."""
        if self._heartbeat is not None:
            try:
                await self._heartbeat.stop()
            except Exception:  # Redis gone: the registry key expires by itself
                log.warning("could not deregister", exc_info=True)
        await self._grpc.stop()
        if self._expiry_task is not None:
            self._expiry_task.cancel()
        await self._mirror.stop()
        self._metrics.shutdown()
        await self._registry.close()
        log.info("kv_pool %s stopped", self.config.node_id, extra={"worker_id": self.config.node_id})

    def _load(self) -> dict[str, float]:
        return dataclasses.asdict(self.store.stats())

    def _advertise_host(self) -> str:
        return socket.gethostname() if self.config.host in WILDCARD_HOSTS else self.config.host

    async def _expire_forever(self) -> None:
        """Releases lapsed leases every ``expiry_interval_s`` (and the scoped blocks with them)."""
        while True:
            await asyncio.sleep(self.config.expiry_interval_s)
            for request_id in self.store.expire():
                log.info("lease lapsed; request released", extra={"request_id": request_id})


async def serve(config: PoolConfig) -> None:
    """Runs one pool node until SIGTERM or SIGINT."""
    server = PoolServer(config)
    await run_until_signalled(server.start, server.stop)
