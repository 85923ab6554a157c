"""The metric-name mapping: every name Tandem exports under vLLM's is one vLLM exports, with the
same type, and the service said to export it does; no Tandem name shadows a vLLM one."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from core import metric_names as names
from worker.metrics import WorkerCollector
from router.cluster_metrics import ClusterCollector
from router.metrics import RouterMetrics
from tests.unit.router.test_cluster_metrics import FakeView

VLLM = Path(__file__).resolve().parents[2] / "data" / "vllm_metrics.txt"  # vLLM 0.32.0's own list


def vllm_metrics() -> dict[str, str]:
    lines = [line.split() for line in VLLM.read_text().splitlines() if line and not line.startswith("#")]
    return {name: kind for name, kind in lines}


LOAD = {"num_requests_running": 3, "num_requests_waiting": 5, "num_used_blocks": 30, "num_total_blocks": 120,
        "num_free_blocks": 90, "num_preemptions": 2, "recent_step_time_s": 0.02, "num_waiting_tokens": 700,
        "cost_kv_load_bytes_per_s": 1e9, "cost_base_s": 0.01, "cost_per_token_s": 1e-5, "cost_per_seq_s": 1e-4,
        "cost_per_attn_s": 1e-6}


def exported(registry: CollectorRegistry) -> dict[str, str]:
    """Family name (counters without ``_total``, as vLLM's list has them) -> type."""
    return {family.name: family.type for family in registry.collect()}


def worker_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(WorkerCollector(lambda: LOAD, "decode", "SmolLM2-135M-Instruct"))
    return registry


def test_every_vllm_compatible_name_is_vllms_with_vllms_type() -> None:
    theirs = vllm_metrics()
    assert len(theirs) > 40  # the file is vLLM's whole list
    for name, (kind, _) in names.VLLM_COMPATIBLE.items():
        assert name in theirs, f"{name} is no vLLM metric"
        assert theirs[name] == kind, (name, theirs[name], kind)


def test_each_service_exports_the_vllm_names_it_is_listed_for() -> None:
    by_service = {"router": exported(RouterMetrics().registry), "worker": exported(worker_registry())}
    for name, (kind, service) in names.VLLM_COMPATIBLE.items():
        assert by_service[service].get(name) == kind, (name, service, by_service[service].get(name))
    # vLLM names only where listed: a vllm: metric with no entry would be an unchecked claim.
    for service, found in by_service.items():
        claimed = {n for n, (_, s) in names.VLLM_COMPATIBLE.items() if s == service}
        assert {n for n in found if n.startswith("vllm:")} == claimed, service


def test_no_tandem_name_duplicates_a_vllm_one() -> None:
    cluster = CollectorRegistry()
    cluster.register(ClusterCollector(FakeView()))
    ours = {**exported(RouterMetrics().registry), **exported(worker_registry()), **exported(cluster)}
    suffixes = {name.split(":", 1)[1] for name in vllm_metrics()}
    shadowing = {n for n in ours if n.startswith("tandem:") and n.split(":", 1)[1] in suffixes}
    assert not shadowing, shadowing
    assert all(n.startswith(("vllm:", "tandem:")) for n in ours), ours


def test_worker_values_follow_the_load() -> None:
    registry = worker_registry()
    labels = {"role": "decode", "model_name": "SmolLM2-135M-Instruct"}
    assert registry.get_sample_value("vllm:kv_cache_usage_perc", labels) == 0.25
    assert registry.get_sample_value("vllm:num_requests_waiting", labels) == 5
    assert registry.get_sample_value("vllm:num_requests_running", labels) == 3
    assert registry.get_sample_value("vllm:num_preemptions_total", labels) == 2
    assert registry.get_sample_value("tandem:kv_blocks", {"role": "decode", "state": "free"}) == 90
    assert registry.get_sample_value("tandem:cost_model_coefficient_seconds",
                                     {"role": "decode", "coefficient": "per_token_s"}) == 1e-5
