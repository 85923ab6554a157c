"""`tandem up` as a user runs it: serves a curl request, and Ctrl-C leaves no process behind,
also when it comes during start-up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from benchmarks.peers import linear_backends
from core import cluster_record
from engine.model.linear import INT8_BACKENDS
from launcher.ports import free_port
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e


def test_tandem_up_serves_curl_and_stops_everything_on_ctrl_c(tmp_path):
    """With ``--quantization int8``: one run proves the command (serving, the cluster record,
    Ctrl-C) and the flag reaching both workers. The default float32 serving is every other e2e
    test's (the LocalCluster that ``tandem up`` runs); a float32 run of this test proved nothing
    more and took ~16 s of the suite."""
    http_port = free_port()
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.Popen(
        [str(tandem), "up", "--http-port", str(http_port), "--grpc-port", str(free_port()),
         "--num-kv-blocks", "128", "--max-model-len", "512", "--log-dir", str(tmp_path), "--quantization", "int8"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "Tandem is up" in line:
                break
        assert any("Tandem is up" in x for x in lines), "".join(lines)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert {"redis-server"} <= {c.name() for c in children} and len(children) >= 5
        curl = subprocess.run(
            ["curl", "-sf", f"http://127.0.0.1:{http_port}/v1/completions", "-H", "content-type: application/json",
             "-d", '{"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 8, '
                   '"temperature": 0}'],
            capture_output=True, text=True, timeout=120,
        )
        assert curl.returncode == 0, curl.stderr
        assert "Paris" in httpx.Response(200, content=curl.stdout).json()["choices"][0]["text"]
        # both workers run their GEMMs on int8 weights: every backend the chooser's log line names
        # ("linear backends: int8_cpu for 5 shapes (...), int8_onednn for ...") is an int8 one
        backends = linear_backends(tmp_path)
        assert len(backends) == 2
        for line in backends.values():
            named = re.findall(r"(?:linear backends: |\), )(\w+) for ", line)
            assert named and set(named) <= set(INT8_BACKENDS), line
        # tandem status finds this cluster without --url (core.cluster_record), until it stops
        ours = [r for r in cluster_record.running() if r.pid == proc.pid]
        assert [r.urls for r in ours] == [(f"http://127.0.0.1:{http_port}",)]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        assert [r for r in cluster_record.running() if r.pid == proc.pid] == []
        poll_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                   timeout_s=10, message="every service process gone")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_ctrl_c_during_start_up_starts_nothing_more(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem_cli", "up", "--http-port", str(free_port()), "--grpc-port", str(free_port()),
         "--num-kv-blocks", "128", "--max-model-len", "512", "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "200"},
    )
    try:
        lines = []
        for line in proc.stdout:  # piped: one line per start-up step
            lines.append(line)
            if line.strip() == "starting prefill":
                break
        assert lines[-1].strip() == "starting prefill", "".join(lines)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert {"redis-server"} <= {c.name() for c in children} and len(children) >= 5  # + pool, workers, router
        signalled_s = time.monotonic()
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
        exited_after_s = time.monotonic() - signalled_s
        assert proc.returncode == 130, rest
        assert rest.splitlines() == ["start-up interrupted while starting prefill; nothing more is started",
                                     "stopped"]
        assert "Tandem is up" not in "".join(lines) + rest
        assert exited_after_s < 20
        # The workers and the router start together (launcher.local_cluster): each was started
        # and each is stopped; no service is left to start after the interrupt.
        assert (tmp_path / "decode.log").exists() and (tmp_path / "router.log").exists()
        # Gone when the launcher exits (it waited for each), not merely killed later with it.
        assert [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE] == []
    finally:
        if proc.poll() is None:
            proc.kill()
