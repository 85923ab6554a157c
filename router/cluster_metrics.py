"""The cluster view on the router's ``/metrics``: every live worker's and pool node's load, as
their heartbeats last published it (core.registry), so one scrape of one router shows the
whole cluster (``tandem up`` users need no Prometheus service discovery).

    tandem:cluster_workers{role}                                   gauge, live processes
    tandem:worker_num_requests_running{role, worker_id}            gauge
    tandem:worker_num_requests_waiting{role, worker_id}            gauge
    tandem:worker_kv_cache_usage_perc{role, worker_id}             gauge, 0..1
    tandem:worker_kv_free_blocks{role, worker_id}                  gauge
    tandem:worker_step_time_seconds{role, worker_id}               gauge, mean of the last ~16 passes
    tandem:worker_waiting_tokens{role, worker_id}                  gauge
    tandem:worker_preemptions_total{role, worker_id}               counter (since the worker started)
    tandem:worker_cost_model_coefficient_seconds{role, worker_id, coefficient}  gauge
    tandem:worker_kv_load_bandwidth_bytes_per_second{role, worker_id}           gauge
    tandem:pool_node_bytes{node_id, tier} / _capacity_bytes{node_id, tier}      gauges
    tandem:pool_node_blocks{node_id, tier}                                      gauge
    tandem:pool_node_hits_total{node_id, tier} / _misses_total{node_id, tier}   counters, blocks looked for
    tandem:pool_node_leases{node_id}                                            gauge

Per-worker names are ``tandem:worker_*``, not vLLM's, so that a query summing ``vllm:*`` over
the workers' own endpoints and this one never counts a worker twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core import metric_names as names
from core.registry import WorkerInfo
from core.worker_load import WorkerLoad
from router.workers.view import WorkerView

WORKER_ROLES = ("prefill", "decode")
COEFFICIENTS = ("base_s", "per_token_s", "per_seq_s", "per_attn_s")
# metric suffix -> (load key, help); tandem:worker_<suffix>
WORKER_GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in the worker's batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests queued at the worker."),
    "kv_free_blocks": ("num_free_blocks", "Free KV cache blocks of the worker."),
    "step_time_seconds": ("recent_step_time_s", "Mean wall time of the worker's last ~16 passes."),
    "waiting_tokens": ("num_waiting_tokens", "Prompt tokens still to compute at the worker."),
    "kv_load_bandwidth_bytes_per_second": ("cost_kv_load_bytes_per_s", "Measured pool -> worker KV bandwidth."),
}


def worker_load(info: WorkerInfo) -> Mapping[str, float]:
    """The numbers a worker or pool node last published, by wire key (the one place that reads
    them): a WorkerLoad's wire form (core.worker_load), or a plain mapping."""
    if info.role == "pool":
        return info.pool_stats
    return info.load.to_wire() if isinstance(info.load, WorkerLoad) else info.load


class ClusterCollector(Collector):
    """Yields the cluster view from ``view`` at every scrape (nothing is cached here)."""

    def __init__(self, view: WorkerView):
        self.view = view

    def collect(self) -> Iterator[Metric]:
        workers = {role: self.view.workers(role) for role in (*WORKER_ROLES, "pool")}
        count = GaugeMetricFamily(names.CLUSTER_WORKERS, "Live processes, by role.", labels=["role"])
        for role, members in workers.items():
            count.add_metric([role], len(members))
        yield count
        yield from worker_metrics([w for role in WORKER_ROLES for w in workers[role]])
        yield from pool_metrics(workers["pool"])


def worker_metrics(workers: list[WorkerInfo]) -> Iterator[Metric]:
    labels = ["role", "worker_id"]
    families = {suffix: GaugeMetricFamily(names.WORKER_PREFIX + suffix, text, labels=labels)
                for suffix, (_, text) in WORKER_GAUGES.items()}
    usage = GaugeMetricFamily(names.WORKER_PREFIX + "kv_cache_usage_perc", "KV cache usage of the worker (0..1).",
                              labels=labels)
    preemptions = CounterMetricFamily(names.WORKER_PREFIX + "preemptions", "Preemptions since the worker started.",
                                      labels=labels)
    coefficient = GaugeMetricFamily(names.WORKER_PREFIX + "cost_model_coefficient_seconds",
                                    "The worker's fitted step-time coefficients.", labels=[*labels, "coefficient"])
    for info in workers:
        load, ids = worker_load(info), [info.role, info.worker_id]
        for suffix, (key, _) in WORKER_GAUGES.items():
            if key in load:
                families[suffix].add_metric(ids, load[key])
        if load.get("num_total_blocks"):
            usage.add_metric(ids, load["num_used_blocks"] / load["num_total_blocks"])
        if "num_preemptions" in load:
            preemptions.add_metric(ids, load["num_preemptions"])
        for name in COEFFICIENTS:
            if f"cost_{name}" in load:
                coefficient.add_metric([*ids, name], load[f"cost_{name}"])
    yield from families.values()
    yield from (usage, preemptions, coefficient)


# pool node family suffix -> (kind, help, dram load key, nvme load key); see kv_pool.block_types.PoolStats
POOL_TIERS = {
    "bytes": (GaugeMetricFamily, "Bytes held, by node and tier.", "used_bytes", "nvme_used_bytes"),
    "capacity_bytes": (GaugeMetricFamily, "Capacity, by node and tier.", "capacity_bytes", "nvme_capacity_bytes"),
    "blocks": (GaugeMetricFamily, "Blocks held, by node and tier.", "num_dram_blocks", "num_nvme_blocks"),
    "hits": (CounterMetricFamily, "Blocks looked for and found, by node and tier.", "num_dram_hits", "num_nvme_hits"),
    "misses": (CounterMetricFamily, "Blocks looked for and not found, by node and tier.", "num_dram_misses",
               "num_nvme_misses"),
}


def pool_metrics(nodes: list[WorkerInfo]) -> Iterator[Metric]:
    families = {suffix: kind(names.POOL_NODE_PREFIX + suffix, text, labels=["node_id", "tier"])
                for suffix, (kind, text, _, _) in POOL_TIERS.items()}
    leases = GaugeMetricFamily(names.POOL_NODE_PREFIX + "leases", "Requests holding a lease, by node.",
                               labels=["node_id"])
    for info in nodes:
        load = worker_load(info)
        has_nvme = bool(load.get("nvme_capacity_bytes"))
        for suffix, (_, _, dram_key, nvme_key) in POOL_TIERS.items():
            if dram_key in load:
                families[suffix].add_metric([info.worker_id, "dram"], load[dram_key])
            if has_nvme and nvme_key in load:
                families[suffix].add_metric([info.worker_id, "nvme"], load[nvme_key])
        if "num_leases" in load:
            leases.add_metric([info.worker_id], load["num_leases"])
    yield from families.values()
    yield leases
