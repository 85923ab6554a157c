"""A service that exits while the cluster starts: the error names it, the cause its log gives
(not the log's raw tail) and the log's path."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launcher import processes
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster, Service
from launcher.supervisor import ServiceStartError, log_cause

TRACEBACK = ("Traceback (most recent call last):\n  File \"x.py\", line 1, in connect\n    await self._connect()\n"
             "redis.exceptions.ConnectionError: Error 111 connecting to 127.0.0.1:1. Connection refused.\n")


def entry(level: str, msg: str, exc: str = "") -> str:
    return json.dumps({"ts": 1.0, "level": level, "logger": "kv_pool", "msg": msg, "service": "kv_pool",
                       **({"exc": exc} if exc else {})})


def test_the_cause_is_the_last_error_entry_and_its_exception_line() -> None:
    log = "\n".join([entry("warning", "could not clear index entries", TRACEBACK), entry("info", "stopped"),
                     entry("error", "kv_pool failed", TRACEBACK), entry("info", "bye")])
    assert log_cause(log) == ("kv_pool failed: redis.exceptions.ConnectionError: Error 111 connecting to "
                              "127.0.0.1:1. Connection refused.")
    assert log_cause(entry("critical", "out of memory")) == "out of memory"


def test_a_log_without_error_entries_gives_its_last_line() -> None:
    assert log_cause("starting\nusage: kv_pool [-h]\nkv_pool: error: unrecognized arguments: --x\n\n") == \
        "kv_pool: error: unrecognized arguments: --x"
    assert log_cause("") == "" and log_cause("\n \n") == ""


def test_a_service_exiting_while_the_cluster_waits_for_it_raises_its_cause(tmp_path: Path) -> None:
    log_path = tmp_path / "kv_pool.log"
    script = f"import sys; print({entry('error', 'kv_pool failed', TRACEBACK)!r}); sys.exit(3)"
    service = Service("kv_pool", processes.spawn([sys.executable, "-c", script], {}, log_path), lambda: False,
                      log_path)
    cluster = LocalCluster(ClusterConfig.from_options(model="m"))
    with pytest.raises(ServiceStartError) as info:
        cluster._wait(service, lambda _: None, timeout_s=60)
    assert str(info.value) == ("kv_pool exited with code 3: kv_pool failed: redis.exceptions.ConnectionError: "
                               f"Error 111 connecting to 127.0.0.1:1. Connection refused.; log {log_path}")
