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
import sys
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


# --- The test process's own memory, and failures named as they happen --------------------------
#
# The whole suite runs in one process beside the clusters it starts; module-scoped fixtures (engines,
# models in several dtypes, KV caches) are freed at module end, but glibc keeps the freed pages in
# its arenas unless asked to return them. Without that, the process grew to 18 GiB on a 23 GiB
# machine and the kernel's OOM killer ended the run with no test named. After each module the
# collector runs and glibc returns what is free; TANDEM_TEST_MEMORY_LOG=<file> also records the
# resident size per module (tab-separated: module, MiB after, MiB before).

def _resident_mib() -> float:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def _return_free_memory() -> None:
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to ask


_module_state: dict[str, object] = {}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    module = item.nodeid.split("::", 1)[0]
    following = nextitem.nodeid.split("::", 1)[0] if nextitem is not None else None
    if following == module:
        return
    # The module's fixtures are finalised in this teardown, and the last test's arguments keep
    # what they returned until it ends (a module-scoped autouse fixture, tried, freed nothing of
    # test_engine_paths' 8.7 GiB): collect when the next test starts (pytest_runtest_setup).
    _module_state["ended"] = module


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    ended = _module_state.pop("ended", None)
    if ended is not None:
        _after_module(ended)
    _share_the_cores(item)


_default_threads: dict[str, int] = {}


def _share_the_cores(item) -> None:
    """In an xdist worker, a test outside SERIAL_DIRS runs torch on one thread: the other
    worker's clusters and model tests use every core, and two OpenMP teams on the same cores
    wait for each other's time slices. SERIAL_DIRS tests get torch's default back."""
    torch = sys.modules.get("torch")  # only where a test module imported it: no import here
    if torch is None or not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    _default_threads.setdefault("torch", torch.get_num_threads())
    wanted = _default_threads["torch"] if _serial(item.nodeid) else 1
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)


def pytest_sessionfinish(session, exitstatus):
    ended = _module_state.pop("ended", None)
    if ended is not None:
        _after_module(ended)


def _after_module(module: str) -> None:
    before = _resident_mib()
    _return_free_memory()
    log = os.environ.get("TANDEM_TEST_MEMORY_LOG")
    if log:
        with open(log, "a") as out:
            out.write(f"{module}\t{_resident_mib():.0f}\t{before:.0f}\n")


# The tests that run the real model or whole clusters (tests/e2e, tests/integration) run one after
# another, in their collection order (tests/e2e/conftest.py orders its shared clusters' tests),
# in one xdist worker (`make test` runs `-n 2`); the others (router, scheduler, manifests, ...:
# mostly one core of Python) run beside them in the other worker, on the core those leave idle
# much of the time (waits on leases and restarts, process start-ups).
SERIAL_DIRS = ("e2e", "integration")
SERIAL_SCOPE = "model-and-clusters"


def _serial(nodeid: str) -> bool:
    path = nodeid.split("::", 1)[0]
    return any(path.startswith(f"tests/{name}/") for name in SERIAL_DIRS)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with every SERIAL_DIRS test in one scope (one work unit: one
    worker, collection order) and every other test a scope of its own. Not ``--dist loadgroup``:
    with pytest 9 its group marks do not reach the scheduler (xdist 3.8 renames ``item._nodeid``,
    which pytest 9 no longer reads), and it spread the cluster tests over both workers."""
    from xdist.scheduler import LoadScopeScheduling

    class SerialScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return SERIAL_SCOPE if _serial(nodeid) else nodeid

    return SerialScopeScheduling(config, log)


def pytest_runtest_logreport(report):
    """Names a failure the moment it happens (-q prints only 'F'): a run killed before its summary
    still says which tests failed."""
    if report.failed:
        when = "" if report.when == "call" else f" (in {report.when})"
        sys.stderr.write(f"\nFAILED {report.nodeid}{when}\n")
        sys.stderr.flush()
