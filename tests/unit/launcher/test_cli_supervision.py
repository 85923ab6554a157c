"""`tandem up`'s supervision loop over a fake cluster: what it prints, when it stops, and what
--no-restart hands the launcher. No process is started."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

import launcher.cli
from launcher.local_cluster import free_port
from launcher.supervisor import RestartPolicy, ServiceExited


class FakeCluster:
    """Stands in for LocalCluster: ``supervise`` returns ``passes`` one at a time, raising the
    exceptions among them."""

    def __init__(self, config, passes):
        self.config, self.passes, self.stopped = config, list(passes), False
        self.http_url, self.grpc_address, self.redis_url = "http://h:1", "h:2", "redis://h:3/0"

    def start(self, on_progress=None, timeout_s=300.0):
        pass

    def supervise(self):
        result = self.passes.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def stop(self):
        self.stopped = True


@pytest.fixture
def run_up(monkeypatch, tmp_path):
    clusters = []

    def invoke(passes, *flags):
        def make(config):
            clusters.append(FakeCluster(config, passes))
            return clusters[-1]

        monkeypatch.setattr(launcher.cli, "LocalCluster", make)
        args = ["up", "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--log-dir", str(tmp_path),
                *flags]
        return CliRunner().invoke(launcher.cli.main, args, terminal_width=200), clusters[-1]

    return invoke


def test_restarts_are_printed_and_a_router_exit_stops_the_cluster(run_up):
    passes = [["decode exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s); see d.log"],
              ["decode restarted"], ServiceExited("router exited (1); the cluster cannot run without it; see r.log")]
    result, cluster = run_up(passes)
    assert result.exit_code == 1
    text = " ".join(result.output.split())  # rich wraps long lines
    assert ("decode exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s); see d.log "
            "decode restarted stopped Error: router exited (1); the cluster cannot run without it; see r.log") in text
    assert cluster.stopped and cluster.passes == []
    assert cluster.config.restart == RestartPolicy(max_restarts=5, window_s=60.0)


def test_no_restart_hands_the_launcher_a_zero_budget(run_up):
    result, cluster = run_up([ServiceExited("decode exited (-9); restarts are off (--no-restart); see d.log")],
                             "--no-restart")
    assert result.exit_code == 1
    assert "Error: decode exited (-9); restarts are off (--no-restart); see d.log" in " ".join(result.output.split())
    assert cluster.config.restart.max_restarts == 0 and cluster.stopped
