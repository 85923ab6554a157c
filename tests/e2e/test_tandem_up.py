"""`tandem up` as a user runs it: serves a curl request, and Ctrl-C leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from launcher.local_cluster import free_port
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e


def test_tandem_up_serves_curl_and_stops_everything_on_ctrl_c(tmp_path):
    http_port = free_port()
    tandem = Path(sys.executable).with_name("tandem")
    proc = subprocess.Popen(
        [str(tandem), "up", "--http-port", str(http_port), "--grpc-port", str(free_port()),
         "--num-kv-blocks", "128", "--max-model-len", "512", "--log-dir", str(tmp_path)],
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
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        poll_until(lambda: not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children),
                   timeout_s=10, message="every service process gone")
    finally:
        if proc.poll() is None:
            proc.kill()
