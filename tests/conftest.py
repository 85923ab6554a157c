"""Fixtures shared by every test: free ports, polling with a deadline, a private Redis server.

Cheap on purpose (no torch, no first-party import): a router test loads only what it uses.
Heavy fixtures live next to their tests (tests/e2e/conftest.py: the shared cluster;
tests/integration/conftest.py: the shared model).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# Tests start servers as subprocesses from a process that talks gRPC: grpcio's fork handlers
# would abort those children before exec (see launcher/__init__.py); set before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")


def _cuda_build() -> bool:
    """Whether the installed torch is built with CUDA, read from torch/version.py without
    importing torch (a CPU build says ``cuda = None``)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return False
    version = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    return "cuda: Optional[str] = None" not in version.read_text() if version.exists() else True


# Triton picks compiled or interpreted per function when a module is first imported, and
# torch._dynamo imports triton itself: without a GPU, switch the interpreter on before any test
# module loads (tests/unit/engine/kernels need it; a test importing torch._dynamo first broke
# them). Only a CUDA build of torch is asked (that import costs ~1 s) whether a GPU is there.
if not _cuda_build():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis


def find_free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def poll_until(condition, timeout_s: float = 10.0, interval_s: float = 0.02, message: str = "condition"):
    """Polls ``condition()`` until it returns a truthy value (returned) or ``timeout_s`` passes.

    Raises:
        TimeoutError: naming ``message`` and the last value seen.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not met within {timeout_s} s (last value: {value!r})")
        time.sleep(interval_s)


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture(scope="session")
def free_port_factory():
    """``free_port_factory()`` -> a free port; for fixtures wider than one test."""
    return find_free_port


@pytest.fixture(scope="session")
def wait_until():
    """``wait_until(condition, timeout_s=10, message=...)``: poll instead of sleeping."""
    return poll_until


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a private, non-persistent redis-server for the whole session (db 0).

    Tests share it: namespace keys per test (unique ids) or use another db number in the URL.
    Skips when ``redis-server`` is not installed.
    """
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    port = find_free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=0.2)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with code {proc.returncode} on port {port}")
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        poll_until(ready, timeout_s=10.0, message=f"redis-server ready on port {port}")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        proc.kill()
        proc.wait(timeout=10)
