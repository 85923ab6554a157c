"""One pool node as a process: block store (DRAM arena + NVMe tier), gRPC, Redis index mirror,
registry, lease and reservation expiry, and the data plane peers copy through (shm, NIXL)."""

from __future__ import annotations

import asyncio
import dataclasses
import glob
import importlib.util
import logging
import os
import socket

from core.grpc_service import GrpcService, run_until_signalled
from core.kv_transfer.host import host_id
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry
from kv_pool.arena import Arena
from kv_pool.block_store import BlockStore, PoolStats
from kv_pool.config import PoolConfig
from kv_pool.index_mirror import IndexMirror
from kv_pool.metrics import PoolMetrics
from kv_pool.nvme_tier import NvmeTier
from kv_pool.peer_puts import PeerPuts
from kv_pool.servicer import SERVICE_NAME, DataPlane, KVPoolServicer
from tandem.v1 import kv_pool_pb2_grpc

log = logging.getLogger(__name__)

WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]")


class PoolServer:
    """Wires the pool's parts together; construct it inside the event loop that runs it."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self._registry = WorkerRegistry(config.redis_url)
        self._mirror = IndexMirror(self._registry.redis, config.node_id)
        self.store: BlockStore | None = None  # made in start (it creates files)
        self._peer_puts: PeerPuts | None = None
        self._nixl = None  # kv_pool.nixl_agent.PoolNixlAgent when NIXL is on
        self._metrics = PoolMetrics(self._stats)
        self._grpc = GrpcService(config.host, config.port, [SERVICE_NAME])
        self._heartbeat: Heartbeat | None = None
        self._expiry_task: asyncio.Task | None = None
        self._sweep_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None  # re-publishes the index after Redis lost it
        self.address = ""

    async def start(self) -> None:
        """Clears stale index entries, serves gRPC, registers as role "pool", starts expiry.

        Raises:
            redis.exceptions.ConnectionError: Redis is unreachable.
            RuntimeError: the gRPC port cannot be bound.
            OSError: the metrics port cannot be bound.
        """
        await self._mirror.start()
        self._serve_store()
        port = await self._grpc.start()
        self.address = self.config.advertise_address or f"{self._advertise_host()}:{port}"
        info = WorkerInfo(worker_id=self.config.node_id, role="pool", address=self.address)
        # The entry carries the pool's stats (WorkerInfo.pool_stats) for the router's cluster view
        # (router.cluster_metrics, tandem status); nothing places by them.
        self._heartbeat = Heartbeat(
            self._registry, info, self._pool_stats, self.config.heartbeat_interval_s, self.config.heartbeat_ttl_s
        )
        await self._heartbeat.start()
        self._expiry_task = asyncio.create_task(self._expire_forever(), name="kv-pool-lease-expiry")
        self._sweep_task = asyncio.create_task(self._sweep_forever(), name="kv-pool-index-sweep")
        self._watch_task = asyncio.create_task(
            self._mirror.watch(self.store.index_events, self.config.heartbeat_interval_s), name="kv-pool-index-watch")
        if self.config.metrics_port:
            self._metrics.serve(self.config.metrics_port, self.config.host)
        log.info(
            "kv_pool %s listening on %s:%d (advertised %s), DRAM %d bytes, NVMe %s, metrics port %d",
            self.config.node_id, self.config.host, port, self.address, self.config.capacity_bytes,
            f"{self.config.nvme_capacity_bytes} bytes in {self.config.nvme_path} ({self.config.nvme_io} I/O)"
            if self.config.nvme_path else "off",
            self.config.metrics_port,
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
        for task in (self._expiry_task, self._sweep_task, self._watch_task):
            if task is not None:
                task.cancel()
        await self._mirror.stop()
        self._metrics.shutdown()
        if self._nixl is not None:
            self._nixl.close()
        if self.store is not None:
            self.store.close()
        await self._registry.close()
        log.info("kv_pool %s stopped", self.config.node_id, extra={"worker_id": self.config.node_id})

    def _serve_store(self) -> None:
        """Creates the arena file, the NVMe tier and the store, and adds the servicer."""
        c = self.config
        arena_path = ""
        if c.arena_dir:
            _remove_dead_arenas(c.arena_dir)
            # The pid keeps two pools with one node id on a host (two test clusters) apart.
            arena_path = os.path.join(c.arena_dir, f"tandem-kv-{c.node_id}-{os.getpid()}.arena")
        arena = Arena(c.capacity_bytes, arena_path, prefault=c.arena_prefault)
        nvme = NvmeTier(c.nvme_path, c.nvme_capacity_bytes, c.nvme_io, arena.buffer) if c.nvme_path else None
        self.store = BlockStore(
            c.capacity_bytes, c.lease_ttl_s, on_event=self._mirror.report, arena=arena, nvme=nvme,
            watermarks=c.watermarks,
        )
        self._peer_puts = PeerPuts(self.store, c.put_reservation_ttl_s)
        data_plane = DataPlane(host_id=host_id(), arena_path=arena_path, arena_bytes=c.capacity_bytes)
        if c.nixl == "on" or (c.nixl == "auto" and importlib.util.find_spec("nixl") is not None):
            from kv_pool.nixl_agent import PoolNixlAgent  # imports nixl, which imports torch

            self._nixl = PoolNixlAgent(f"tandem-pool-{c.node_id}-{os.getpid()}", arena)
            data_plane = dataclasses.replace(
                data_plane, nixl_agent_name=self._nixl.name, nixl_agent_metadata=self._nixl.metadata,
                nixl_arena_address=self._nixl.arena_address,
            )
        servicer = KVPoolServicer(self.store, self._metrics, c.lease_ttl_s, self._peer_puts, data_plane)
        kv_pool_pb2_grpc.add_KVPoolServicer_to_server(servicer, self._grpc.server)

    def _pool_stats(self) -> dict[str, float]:
        return dataclasses.asdict(self._stats())

    def _stats(self) -> PoolStats:
        if self.store is None:  # not started yet: an empty pool
            return PoolStats(self.config.capacity_bytes, *[0] * 9)
        return self.store.stats()

    def _advertise_host(self) -> str:
        return socket.gethostname() if self.config.host in WILDCARD_HOSTS else self.config.host

    async def _sweep_forever(self) -> None:
        """Every ``2 * heartbeat_ttl_s``: removes index entries of pool nodes whose registry key
        expired (killed with -9), so the index never points at a dead node for long."""
        while True:
            await asyncio.sleep(2 * self.config.heartbeat_ttl_s)
            try:
                live = {w.worker_id for w in await self._registry.list_workers("pool")}
                if self.config.node_id in live:  # our own view of Redis is sane
                    num_swept = await self._mirror.sweep_dead_nodes(live)
                    if num_swept:
                        log.info("removed %d index entries of dead pool nodes", num_swept)
            except Exception:  # Redis hiccup: try again next round
                log.warning("index sweep failed", exc_info=True)

    async def _expire_forever(self) -> None:
        """Releases lapsed leases every ``expiry_interval_s`` (and the scoped blocks with them)."""
        while True:
            await asyncio.sleep(self.config.expiry_interval_s)
            num_rolled_back = self._peer_puts.expire()
            if num_rolled_back:
                log.warning("rolled back %d peer reservations never committed", num_rolled_back)
            for request_id in self.store.expire():
                log.info("lease lapsed; request released", extra={"request_id": request_id})


def _remove_dead_arenas(arena_dir: str) -> None:
    """Deletes arena files of pool processes that no longer run (killed with -9): a tmpfs file
    keeps its memory until unlinked."""
    for path in glob.glob(os.path.join(arena_dir, "tandem-kv-*-*.arena")):
        pid = path.rsplit("-", 1)[1].removesuffix(".arena")
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(path)
                log.info("removed the arena file of dead pool process %s: %s", pid, path)
            except OSError:
                pass


async def serve(config: PoolConfig) -> None:
    """Runs one pool node until SIGTERM or SIGINT."""
    server = PoolServer(config)
    await run_until_signalled(server.start, server.stop)
