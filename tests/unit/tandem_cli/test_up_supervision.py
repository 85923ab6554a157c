"""`tandem up`'s supervision loop over a fake cluster: what it prints, when it stops, what
--no-restart hands the launcher, and Ctrl-C during start-up. No process is started."""

from __future__ import annotations

import signal

import pytest
from click.testing import CliRunner

import tandem_cli.main
import tandem_cli.up
from launcher.ports import free_port
from launcher.supervisor import RestartPolicy, ServiceExited, ServiceStartError, StartInterrupted


class FakeCluster:
    """Stands in for LocalCluster: ``supervise`` returns ``passes`` one at a time, raising the
    exceptions among them. ``start`` runs ``on_start`` (a signal arriving, say), then raises
    StartInterrupted as LocalCluster does once ``interrupted()`` is true."""

    def __init__(self, config, passes, interrupted, on_start=lambda: None):
        self.config, self.passes, self.stopped = config, list(passes), False
        self.interrupted, self.on_start = interrupted, on_start
        self.http_url, self.grpc_address, self.redis_url = "http://h:1", "h:2", "redis://h:3/0"

    def start(self, on_progress=None, timeout_s=300.0):
        self.on_start()
        if self.interrupted():
            raise StartInterrupted("decode")

    def supervise(self):
        result = self.passes.pop(0)
        if isinstance(result, Exception):
            raise result
        return result

    def stop(self):
        self.stopped = True


@pytest.fixture
def signal_handlers(monkeypatch) -> dict:
    """The handlers `tandem up` installs, by signal, kept out of the test process."""
    handlers = {}
    monkeypatch.setattr(tandem_cli.up.signal, "signal", lambda signum, handler: handlers.__setitem__(signum, handler))
    return handlers


@pytest.fixture
def run_up(monkeypatch, tmp_path, signal_handlers):
    clusters = []
    # The cluster is a fake: what this machine has free now (a busy CI machine) must not refuse it.
    monkeypatch.setattr("launcher.machine_fit.available_memory_bytes", lambda: 64 << 30)

    def invoke(passes, *flags, on_start=lambda: None):
        def make(config, interrupted):
            clusters.append(FakeCluster(config, passes, interrupted, on_start))
            return clusters[-1]

        monkeypatch.setattr(tandem_cli.up, "LocalCluster", make)
        args = ["up", "--http-port", str(free_port()), "--grpc-port", str(free_port()), "--log-dir", str(tmp_path),
                *flags]
        return CliRunner().invoke(tandem_cli.main.main, args, terminal_width=200), clusters[-1]

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


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_start_up_stops_without_the_banner(run_up, signal_handlers, signum, exit_code):
    result, cluster = run_up([], on_start=lambda: signal_handlers[signum](signum, None))
    assert result.exit_code == exit_code
    assert result.output.splitlines() == [
        "start-up interrupted while starting decode; nothing more is started", "stopped"]
    assert cluster.stopped and "Tandem is up" not in result.output


def test_a_service_that_fails_to_start_is_one_error_line_with_its_cause(run_up):
    cause = ("kv_pool exited with code 1: kv_pool failed: redis.exceptions.ConnectionError: Error 111 connecting "
             "to 127.0.0.1:1. Connection refused.; log logs/kv_pool.log")

    def fail():
        raise ServiceStartError(cause)

    result, cluster = run_up([], on_start=fail)
    assert result.exit_code == 1
    assert " ".join(result.output.split()).endswith(f"stopped Error: {cause}")  # no traceback
    assert "Traceback" not in result.output and cluster.stopped


def test_port_0_starts_the_router_on_a_free_port_the_launcher_knows(run_up):
    result, cluster = run_up([["all well"], ServiceExited("router exited (0)")], "--http-port", "0", "--grpc-port", "0")
    assert result.exit_code == 1
    http_port, grpc_port = cluster.config.http_port, cluster.config.grpc_port
    assert 0 < http_port < 65536 and 0 < grpc_port < 65536 and http_port != grpc_port
