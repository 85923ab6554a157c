"""Prometheus metrics of one pool node (docs/design.md §9b).

Block counts and the store's cumulative counters are read from ``BlockStore.stats()`` at scrape
time, so the store needs no metric calls; transfer bytes are counted by the servicer.

    tandem:pool_blocks{state=writing|stored|leased|scoped}   gauge
    tandem:pool_leases                                      gauge, requests holding a lease
    tandem:pool_used_bytes / tandem:pool_capacity_bytes      gauges
    tandem:pool_evictions_total                             counter
    tandem:pool_transfer_bytes_total{direction=put|get}     counter, block bytes received / sent over
                                                            every transport: put as streamed by
                                                            gRPC or written and committed by a
                                                            shm / NIXL peer; get as leased to a
                                                            reader (LocateBlocks, which every
                                                            transport calls before it copies)
    tandem:pool_tier_blocks{tier=dram|nvme}                 gauge
    tandem:pool_tier_bytes{tier}                            gauge, bytes held
    tandem:pool_tier_capacity_bytes{tier}                   gauge
    tandem:pool_tier_hits_total{tier} / _misses_total{tier} counters, blocks looked for
    tandem:pool_tier_evictions_total{tier}                  counter (dram: demoted or dropped; nvme: dropped)
    tandem:pool_tier_promotions_total{tier}                 counter, blocks read back from the tier into DRAM
    tandem:pool_tier_demotions_total{tier}                  counter, blocks written into the tier by eviction
    tandem:pool_corrupt_blocks_total                        counter, dropped on a checksum mismatch
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kv_pool.block_types import PoolStats


class _StatsCollector(Collector):
    def __init__(self, stats_fn: Callable[[], PoolStats]):
        self._stats_fn = stats_fn

    def collect(self) -> Iterator[Metric]:
        stats = self._stats_fn()
        blocks = GaugeMetricFamily("tandem:pool_blocks", "Pool blocks by state.", labels=["state"])
        blocks.add_metric(["writing"], stats.num_writing_blocks)
        blocks.add_metric(["stored"], stats.num_stored_blocks)
        blocks.add_metric(["leased"], stats.num_leased_blocks)
        blocks.add_metric(["scoped"], stats.num_scoped_blocks)
        yield blocks
        yield GaugeMetricFamily("tandem:pool_leases", "Requests holding a lease.", value=stats.num_leases)
        yield GaugeMetricFamily("tandem:pool_used_bytes", "Bytes held by blocks.", value=stats.used_bytes)
        yield GaugeMetricFamily("tandem:pool_capacity_bytes", "Bytes the pool may hold.", value=stats.capacity_bytes)
        yield CounterMetricFamily("tandem:pool_evictions", "Blocks evicted by LRU.", value=stats.num_evicted_blocks)
        yield from _tier_metrics(stats)
        yield CounterMetricFamily(
            "tandem:pool_corrupt_blocks", "Blocks dropped on a checksum mismatch.", value=stats.num_corrupt_blocks
        )


def _tier_metrics(stats: PoolStats) -> Iterator[Metric]:
    """One family per quantity, one sample per tier (``tier`` label)."""
    rows = {
        # name: (kind, help, dram value, nvme value)
        "blocks": (GaugeMetricFamily, "Blocks held, by tier.", stats.num_dram_blocks, stats.num_nvme_blocks),
        "bytes": (GaugeMetricFamily, "Bytes held, by tier.", stats.used_bytes, stats.nvme_used_bytes),
        "capacity_bytes": (GaugeMetricFamily, "Capacity, by tier.", stats.capacity_bytes, stats.nvme_capacity_bytes),
        "hits": (CounterMetricFamily, "Blocks looked for and found, by tier.", stats.num_dram_hits,
                 stats.num_nvme_hits),
        "misses": (CounterMetricFamily, "Blocks looked for and not found, by tier.", stats.num_dram_misses,
                   stats.num_nvme_misses),
        "evictions": (CounterMetricFamily, "Blocks evicted, by tier.", stats.num_evicted_blocks,
                      stats.num_nvme_evictions),
        "promotions": (CounterMetricFamily, "Blocks promoted out of the tier into DRAM.", 0,
                       stats.num_nvme_promotions),
        "demotions": (CounterMetricFamily, "Blocks demoted into the tier.", 0, stats.num_nvme_demotions),
    }
    for name, (kind, help_text, dram, nvme) in rows.items():
        family = kind(f"tandem:pool_tier_{name}", help_text, labels=["tier"])
        family.add_metric(["dram"], dram)
        if stats.nvme_capacity_bytes:
            family.add_metric(["nvme"], nvme)
        yield family


class PoolMetrics:
    """The metrics of one pool in their own registry (no process-wide global)."""

    def __init__(self, stats_fn: Callable[[], PoolStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(stats_fn))
        self._transfer_bytes = Counter(
            "tandem:pool_transfer_bytes",
            "Block bytes received (put) and sent (get).",
            labelnames=["direction"],
            registry=self.registry,
        )
        self._put_bytes = self._transfer_bytes.labels(direction="put")
        self._get_bytes = self._transfer_bytes.labels(direction="get")
        self._http_server: WSGIServer | None = None

    def count_put_bytes(self, num_bytes: int) -> None:
        self._put_bytes.inc(num_bytes)

    def count_get_bytes(self, num_bytes: int) -> None:
        self._get_bytes.inc(num_bytes)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serves ``/metrics`` on ``host:port`` from a daemon thread until ``shutdown``.

        Raises:
            OSError: the port cannot be bound.
        """
        self._http_server, _ = start_http_server(port, addr=host, registry=self.registry)

    def shutdown(self) -> None:
        """Stops the ``/metrics`` server if one runs."""
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None
