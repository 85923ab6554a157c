"""`tandem status`: reads the router's /metrics (its own metrics + the cluster view) and renders
workers, pool nodes and router rates; histogram percentiles as Prometheus computes them."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from rich.console import Console

import tandem_cli.main
from core import cluster_record
from tandem_cli import status
from tandem_cli.status import Snapshot, choose_url, histogram_quantile, metrics_url, render
from router.cluster_metrics import ClusterCollector
from router.metrics import RouterMetrics
from tests.unit.router.test_cluster_metrics import FakeView


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch) -> None:
    """No cluster recorded by a real tandem up on this machine takes part."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


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


def test_a_url_without_a_scheme_is_taken_as_http() -> None:
    assert metrics_url("127.0.0.1:18500") == "http://127.0.0.1:18500/metrics"
    assert choose_url("127.0.0.1:18500", []) == ("http://127.0.0.1:18500", "")


def test_without_url_the_cluster_tandem_up_runs_here_is_shown(tmp_path: Path) -> None:
    folder = tmp_path / "records"
    assert choose_url(None, cluster_record.running(folder)) == (
        "http://127.0.0.1:8000", "no cluster started by tandem up is recorded here: the default port")
    path = cluster_record.write(["http://127.0.0.1:18500"], tmp_path / "logs", folder)
    records = cluster_record.running(folder)
    assert [(r.pid, r.urls) for r in records] == [(os.getpid(), ("http://127.0.0.1:18500",))]
    assert choose_url(None, records)[0] == "http://127.0.0.1:18500"
    assert choose_url("h:1", records)[0] == "http://h:1"  # --url wins
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / f"{gone.stdout.strip()}.json"
    stale.write_text(path.read_text().replace(str(os.getpid()), gone.stdout.strip()))
    assert len(cluster_record.running(folder)) == 1 and not stale.exists()  # a dead tandem up's file goes
    second = folder / "1.json"  # pid 1 is alive: a second cluster
    second.write_text(path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 1')
                      .replace("18500", "18600"))
    with pytest.raises(click.UsageError) as info:
        choose_url(None, cluster_record.running(folder))
    assert info.value.message.startswith("2 clusters started by tandem up run here (")
    assert "pid 1: http://127.0.0.1:18600" in info.value.message and info.value.message.endswith("); pass --url")
    cluster_record.remove(path)
    assert [r.urls for r in cluster_record.running(folder)] == [("http://127.0.0.1:18600",)]


def test_status_reads_the_recorded_cluster_and_prints_whole_rows(tmp_path: Path, monkeypatch) -> None:
    cluster_record.write(["http://127.0.0.1:18500"], tmp_path / "logs")  # under TANDEM_CACHE_DIR
    read = []
    monkeypatch.setattr(status, "scrape", lambda url, key="": read.append(url) or Snapshot.parse(router_text(1), 1.0))
    result = CliRunner().invoke(tandem_cli.main.main, ["status", "--once"])
    assert result.exit_code == 0, result.output
    assert read == ["http://127.0.0.1:18500/metrics"]
    assert "Tandem cluster at http://127.0.0.1:18500" in result.output
    assert max(len(line) for line in result.output.splitlines()) > 100  # piped: not cut at 80 columns


def test_an_unreachable_default_router_says_to_pass_url() -> None:
    result = CliRunner().invoke(tandem_cli.main.main, ["status", "--url", "127.0.0.1:9", "--once"])
    assert result.exit_code == 1
    assert result.output.endswith("; is a cluster up there? pass --url with its router's address (tandem up prints "
                                  "it)\n")
