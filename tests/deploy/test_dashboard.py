"""The Grafana dashboard: in sync with its generator, shipped unchanged by the chart, and every
panel's query names metrics (and labels) that some service really exports."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from kv_pool.block_types import PoolStats
from kv_pool.metrics import PoolMetrics
from core.kv_transfer.metered import TransferMetrics
from worker.metrics import WorkerCollector
from router.cluster_metrics import ClusterCollector
from router.metrics import RouterMetrics
from tests.deploy.test_manifests import CHART, DEPLOY, REPO, helm_template
from tests.deploy.test_manifests import tools  # noqa: F401  (the fixture)
from tests.unit.core.test_metric_names import LOAD
from tests.unit.router.test_cluster_metrics import FakeView

DASHBOARD = CHART / "dashboards" / "tandem.json"
METRIC = re.compile(r"\b(?:vllm|tandem):[a-z0-9_:]+")
BY = re.compile(r"\bby \(([^)]*)\)")
MATCHER = re.compile(r"\{([^}]*)\}")


def exported() -> dict[str, set[str]]:
    """Every sample name the services export -> its label names, with each labelled metric
    exercised once (a labelled metric has no sample until then)."""
    router = RouterMetrics()
    router.registry.register(ClusterCollector(FakeView()))
    router.rejected("slo_unattainable"), router.worker_failed("decode"), router.prefill_retried(), router.migrated()
    router.placed("predicted_latency", "disaggregated"), router.ttft_predicted("disaggregated", 0.1, 0.2)
    router.routed("predicted_latency", "decode"), router.first_token(0.1, 10, 4), router.output_tokens(2, 0.1)
    router.finished("stop", 1.0)
    worker = CollectorRegistry()
    worker.register(WorkerCollector(lambda: LOAD, "decode", "m"))
    pool = PoolMetrics(lambda: PoolStats(100, 10, 0, 1, 0, 0, 0, 0, 0, 0, nvme_capacity_bytes=100))
    pool.count_put_bytes(1), pool.count_get_bytes(1)
    transfer_registry = CollectorRegistry()
    transfer = TransferMetrics(transfer_registry)
    transfer.timed("grpc", "read", lambda: [], lambda _: 0)
    with pytest.raises(OSError):
        transfer.timed("grpc", "write", lambda: (_ for _ in ()).throw(OSError("x")), lambda _: 0)
    names: dict[str, set[str]] = {}
    for registry in (router.registry, worker, pool.registry, transfer_registry):
        for family in registry.collect():
            for s in family.samples:
                names.setdefault(s.name, set()).update(s.labels)
    return names


def queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] if p["type"] != "row" for t in p["targets"]]


def test_the_file_is_what_the_generator_writes() -> None:
    result = subprocess.run([sys.executable, str(DEPLOY / "grafana" / "make_dashboard.py"), "--check"],
                            cwd=REPO, capture_output=True, timeout=60)
    assert result.returncode == 0, "dashboards/tandem.json is stale: run deploy/grafana/make_dashboard.py"


def test_every_query_names_exported_metrics_and_their_labels() -> None:
    names = exported()
    assert len(queries()) > 30
    for title, expr in queries():
        used = METRIC.findall(expr)
        if expr.startswith("vector($"):  # an SLO line from a dashboard variable
            continue
        assert used, (title, expr)
        missing = [n for n in used if n not in names]
        assert not missing, f"panel {title!r} reads {missing}, which no service exports"
        labels = set().union(*(names[n] for n in used))
        grouped = {label.strip() for group in BY.findall(expr) for label in group.split(",") if label.strip()}
        matched = {m.split("=")[0].strip() for group in MATCHER.findall(expr) for m in group.split(",") if m}
        assert grouped | matched <= labels, f"panel {title!r} uses labels {sorted((grouped | matched) - labels)}"


def test_the_panels_the_issue_asks_for_exist() -> None:
    titles = {title for title, _ in queries()}
    for wanted in ("TTFT vs SLO", "TBT (inter-token latency) vs SLO", "Goodput", "Queue per worker",
                   "KV cache usage per worker", "Pool tier usage", "Pool hit rate by tier", "KV transfer bandwidth",
                   "Placements by mode", "Rejections by reason", "Failures"):
        assert wanted in titles, wanted


def test_the_chart_ships_the_file_for_the_grafana_sidecar(tools) -> None:  # noqa: F811
    objects = helm_template(tools)
    [config_map] = [o for o in objects if o["kind"] == "ConfigMap" and "tandem.json" in (o.get("data") or {})]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config_map["data"]["tandem.json"]) == json.loads(DASHBOARD.read_text())
    off = helm_template(tools, "--set", "metrics.dashboard.enabled=false")
    assert not [o for o in off if o["kind"] == "ConfigMap" and "tandem.json" in (o.get("data") or {})]
