"""router.cluster_metrics: the router's /metrics carries every live worker's and pool node's
heartbeat load, one sample per process, and follows the view at each scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from core.registry import WorkerInfo
from router.cluster_metrics import ClusterCollector

DECODE_LOAD = {"num_requests_running": 4, "num_requests_waiting": 1, "num_used_blocks": 64, "num_total_blocks": 256,
               "num_free_blocks": 192, "recent_step_time_s": 0.05, "num_preemptions": 3, "cost_per_token_s": 2e-5,
               "num_waiting_tokens": 30, "cost_kv_load_bytes_per_s": 2e9}
POOL_LOAD = {"capacity_bytes": 1000, "used_bytes": 250, "num_dram_blocks": 5, "num_dram_hits": 40,
             "num_dram_misses": 10, "nvme_capacity_bytes": 4000, "nvme_used_bytes": 100, "num_nvme_blocks": 2,
             "num_nvme_hits": 6, "num_nvme_misses": 4, "num_leases": 1}


class FakeView:
    """What ClusterCollector reads of a WorkerView: ``workers(role)``."""

    def __init__(self, workers: list[WorkerInfo] | None = None):
        self.all = workers if workers is not None else [
            WorkerInfo("decode-0", "decode", "127.0.0.1:1", dict(DECODE_LOAD)),
            WorkerInfo("prefill-0", "prefill", "127.0.0.1:2", {"num_requests_running": 2, "num_used_blocks": 0,
                                                               "num_total_blocks": 128}),
            WorkerInfo("pool-0", "pool", "127.0.0.1:3", pool_stats=dict(POOL_LOAD)),
        ]

    def workers(self, role: str) -> list[WorkerInfo]:
        return [w for w in self.all if w.role == role]


def registry_of(view: FakeView) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ClusterCollector(view))
    return registry


def test_one_sample_per_live_process_from_its_heartbeat() -> None:
    r = registry_of(FakeView())
    decode = {"role": "decode", "worker_id": "decode-0"}
    assert [r.get_sample_value("tandem:cluster_workers", {"role": role}) for role in ("prefill", "decode", "pool")] == [1, 1, 1]
    assert r.get_sample_value("tandem:worker_kv_cache_usage_perc", decode) == 0.25
    assert r.get_sample_value("tandem:worker_num_requests_running", decode) == 4
    assert r.get_sample_value("tandem:worker_step_time_seconds", decode) == 0.05
    assert r.get_sample_value("tandem:worker_preemptions_total", decode) == 3
    assert r.get_sample_value("tandem:worker_cost_model_coefficient_seconds", {**decode, "coefficient": "per_token_s"}) == 2e-5
    assert r.get_sample_value("tandem:worker_num_requests_running", {"role": "prefill", "worker_id": "prefill-0"}) == 2
    # a key the heartbeat lacks gives no sample rather than a made-up 0
    assert r.get_sample_value("tandem:worker_num_requests_waiting", {"role": "prefill", "worker_id": "prefill-0"}) is None
    node = {"node_id": "pool-0"}
    assert r.get_sample_value("tandem:pool_node_bytes", {**node, "tier": "dram"}) == 250
    assert r.get_sample_value("tandem:pool_node_capacity_bytes", {**node, "tier": "nvme"}) == 4000
    assert r.get_sample_value("tandem:pool_node_hits_total", {**node, "tier": "dram"}) == 40
    assert r.get_sample_value("tandem:pool_node_misses_total", {**node, "tier": "nvme"}) == 4
    assert r.get_sample_value("tandem:pool_node_leases", node) == 1


def test_each_scrape_reads_the_view_again() -> None:
    view = FakeView()
    r = registry_of(view)
    assert r.get_sample_value("tandem:worker_num_requests_running", {"role": "decode", "worker_id": "decode-0"}) == 4
    view.all = [w for w in view.all if w.role != "decode"]  # the worker's heartbeat lapsed
    assert r.get_sample_value("tandem:cluster_workers", {"role": "decode"}) == 0
    assert r.get_sample_value("tandem:worker_num_requests_running", {"role": "decode", "worker_id": "decode-0"}) is None


def test_a_pool_without_nvme_reports_dram_only() -> None:
    load = {k: v for k, v in POOL_LOAD.items() if not k.startswith(("nvme", "num_nvme"))}
    r = registry_of(FakeView([WorkerInfo("pool-1", "pool", "127.0.0.1:4", pool_stats=load)]))
    assert r.get_sample_value("tandem:pool_node_blocks", {"node_id": "pool-1", "tier": "dram"}) == 5
    assert r.get_sample_value("tandem:pool_node_blocks", {"node_id": "pool-1", "tier": "nvme"}) is None
