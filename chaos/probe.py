"""What the cluster holds, read through its stats RPCs and /proc: idle or not, leaked, RSS."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping

import grpc

from launcher.local_cluster import LocalCluster
from tandem.v1 import decode_worker_pb2_grpc, kv_pool_pb2, kv_pool_pb2_grpc, prefill_worker_pb2, prefill_worker_pb2_grpc

POOL_BUSY_FIELDS = ("num_writing_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases")
WORKER_BUSY_FIELDS = ("num_used_blocks", "num_requests_running", "num_requests_waiting")
STATS_TIMEOUT_S = 5.0
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _stub(name: str, channel: grpc.Channel):
    if name == "kv_pool":
        return kv_pool_pb2_grpc.KVPoolStub(channel)
    if name.startswith("prefill"):
        return prefill_worker_pb2_grpc.PrefillWorkerStub(channel)
    return decode_worker_pb2_grpc.DecodeWorkerStub(channel)


class ClusterProbe:
    """Stats of the pool and every worker process of ``cluster`` (blocking gRPC calls); with
    ``addresses`` (service name -> gRPC address: ``kv_pool``, ``prefill...``, ``decode...``)
    those services instead, e.g. the pods of a Kubernetes node at their pod IPs, and no RSS
    (``cluster`` None: no process of theirs here)."""

    def __init__(self, cluster: LocalCluster | None, addresses: Mapping[str, str] | None = None):
        self.cluster = cluster
        if addresses is None:
            addresses = cluster.addresses
        self._channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}

    def busy(self) -> dict[str, int]:
        """Non-idle counts by ``service.field`` (empty when idle): pool blocks writing, leased or
        scoped and leases; worker blocks used and requests running or waiting. A service that
        does not answer counts as ``service.unreachable`` 1."""
        found: dict[str, int] = {}
        for name, channel in self._channels.items():
            fields = POOL_BUSY_FIELDS if name == "kv_pool" else WORKER_BUSY_FIELDS
            request = kv_pool_pb2.GetPoolStatsRequest() if name == "kv_pool" else prefill_worker_pb2.GetWorkerStatsRequest()
            try:
                stats = _stub(name, channel).GetStats(request, timeout=STATS_TIMEOUT_S)
            except grpc.RpcError:
                found[f"{name}.unreachable"] = 1
                continue
            found.update({f"{name}.{f}": getattr(stats, f) for f in fields if getattr(stats, f)})
        return found

    def pool_capacity_bytes(self) -> int:
        stats = _stub("kv_pool", self._channels["kv_pool"]).GetStats(kv_pool_pb2.GetPoolStatsRequest(),
                                                                      timeout=STATS_TIMEOUT_S)
        return stats.capacity_bytes - stats.used_bytes

    def gauges(self) -> dict[str, int]:
        """Every integer field of each service's GetStats answer, by ``service.field`` (a service
        that does not answer is left out)."""
        found: dict[str, int] = {}
        for name, channel in self._channels.items():
            request = kv_pool_pb2.GetPoolStatsRequest() if name == "kv_pool" else prefill_worker_pb2.GetWorkerStatsRequest()
            try:
                stats = _stub(name, channel).GetStats(request, timeout=STATS_TIMEOUT_S)
            except grpc.RpcError:
                continue
            for descriptor in stats.DESCRIPTOR.fields:  # zeros too (ListFields leaves them out)
                value = getattr(stats, descriptor.name)
                if isinstance(value, int) and not isinstance(value, bool):
                    found[f"{name}.{descriptor.name}"] = value
        return found

    def rss_by_service(self) -> dict[str, int]:
        """Resident memory of each service process by name (Linux /proc; 0 for one that is gone)."""
        found: dict[str, int] = {}
        for service in self.cluster.services if self.cluster is not None else ():
            try:
                with open(f"/proc/{service.process.pid}/statm") as f:
                    found[service.name] = int(f.read().split()[1]) * PAGE_BYTES
            except (OSError, IndexError, ValueError):
                found[service.name] = 0
        return found

    def rss_bytes(self) -> int:
        """Resident memory of every service process, summed (Linux /proc; 0 for one that is gone)."""
        return sum(self.rss_by_service().values())

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


async def wait_idle(probe: ClusterProbe, bound_s: float) -> tuple[float | None, dict[str, int], dict[str, int]]:
    """Polls ``probe.busy()`` every 0.5 s until the pool and workers hold nothing or ``bound_s``
    seconds pass. Returns (seconds it took, None when never; what was held at the first poll;
    what was still held at the end, empty when idle)."""
    start = time.monotonic()
    held_at_start = busy = await asyncio.to_thread(probe.busy)
    while busy:
        if time.monotonic() - start > bound_s:
            return None, held_at_start, busy
        await asyncio.sleep(0.5)  # polling stats, not synchronising
        busy = await asyncio.to_thread(probe.busy)
    return time.monotonic() - start, held_at_start, {}
