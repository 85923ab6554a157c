"""`tandem status`: reads the router's /metrics (its own metrics + the cluster view) and renders
workers, pool nodes and router rates; histogram percentiles as Prometheus computes them."""

from __future__ import annotations

import math
from pathlib import Path

from click.testing import CliRunner
from prometheus_client import generate_latest
from rich.console import Console

import tandem_cli.main
from tandem_cli import status
from tandem_cli.status import Snapshot, histogram_quantile, metrics_url, render
from router.cluster_metrics import ClusterCollector
from router.metrics import RouterMetrics
from tests.unit.router.test_cluster_metrics import FakeView


def router_text(num_finished: int) -> str:
    metrics = RouterMetrics()
    metrics.registry.register(ClusterCollector(FakeView()))
    for _ in range(num_finished):
        metrics.first_token(0.03, num_prompt_tokens=10, num_cached_tokens=5)
        metrics.output_tokens(4, 0.2)
        metrics.finished("stop", 1.0)
    return generate_latest(metrics.registry).decode()


def text_of(renderable) -> str:
    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    console.print(renderable)
    return console.export_text()


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 5.0, 0.5: 10.0, math.inf: 10.0}
    assert histogram_quantile(0.5, buckets) == 0.1
    assert math.isclose(histogram_quantile(0.75, buckets), 0.3)
    assert histogram_quantile(0.99, {0.1: 0.0, 1.0: 0.0, math.inf: 4.0}) == 1.0  # only +Inf: its lower bound
    assert math.isnan(histogram_quantile(0.5, {0.1: 0.0, math.inf: 0.0}))


def test_snapshot_reads_the_cluster_view_and_the_router() -> None:
    snap = Snapshot.parse(router_text(3), 10.0)
    assert snap.value("vllm:request_success_total") == 3
    assert snap.value("vllm:generation_tokens_total") == 15  # 1 first + 4 per request
    assert snap.value("tandem:worker_kv_cache_usage_perc", role="decode", worker_id="decode-0") == 0.25
    assert snap.by("tandem:pool_node_bytes", "node_id", "tier") == {("pool-0", "dram"): 250, ("pool-0", "nvme"): 100}


def test_render_shows_workers_pool_and_rates() -> None:
    before, after = Snapshot.parse(router_text(2), 10.0), Snapshot.parse(router_text(6), 12.0)
    text = text_of(render(after, before))
    assert "live processes: prefill 1  decode 1  pool 1" in text
    rows = {cells[1] + " " + cells[2]: cells[1:-1] for cells in
            ([c.strip() for c in line.split("│")] for line in text.splitlines() if line.count("│") > 2)}
    # role, worker, running, waiting, KV used, free blocks, step ms, cost base ms, us/token, us/seq
    assert rows["decode decode-0"] == ["decode", "decode-0", "4", "1", "25.0%", "192", "50.0", "-", "20.0", "-"]
    # node, tier, used, capacity, used %, blocks, hit rate, leases
    assert rows["pool-0 dram"] == ["pool-0", "dram", "250 B", "1000 B", "25.0%", "5", "80.0%", "1"]
    assert rows["pool-0 nvme"] == ["pool-0", "nvme", "100 B", "3.9 KiB", "2.5%", "2", "60.0%", ""]
    assert rows["finished requests 6"] == ["finished requests", "6", "2.00"]  # 4 more in 2 s
    assert "rates over 2.0 s" in text
    assert "prefix cache hit rate │ 50.0%" in text


def test_url_forms_and_svg_export(tmp_path: Path, monkeypatch) -> None:
    assert metrics_url("http://h:8000") == metrics_url("http://h:8000/v1/") == "http://h:8000/metrics"
    snaps = iter([Snapshot.parse(router_text(1), 1.0), Snapshot.parse(router_text(3), 2.0)])
    monkeypatch.setattr(status, "scrape", lambda url, key="": next(snaps))
    svg = tmp_path / "status.svg"
    result = CliRunner().invoke(tandem_cli.main.main, ["status", "--svg", str(svg), "--interval-s", "0.1"])
    assert result.exit_code == 0, result.output
    content = svg.read_text()
    assert content.startswith("<svg") and "decode-0" in content


def test_an_unreachable_router_is_one_clear_error() -> None:
    result = CliRunner().invoke(tandem_cli.main.main, ["status", "--url", "http://127.0.0.1:9", "--once"])
    assert result.exit_code == 1
    assert result.output.startswith("Error: cannot read http://127.0.0.1:9/metrics:")
