"""The clusters (real processes, real model) the end-to-end tests share: ``cluster``
(disaggregated) and ``colocated_cluster``, each stopped after the last test that uses it, and
:class:`ClusterProbe`, which reads a cluster's state through its stats RPCs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from launcher.config import ClusterConfig

from launcher.local_cluster import LocalCluster

from launcher.ports import free_port
from tandem.v1 import decode_worker_pb2_grpc, kv_pool_pb2, kv_pool_pb2_grpc, prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.conftest import poll_until

BLOCK_SIZE = 16


class ClusterProbe:
    """Reads the cluster's state through its stats RPCs (never through internals).

    ``prefill_stats``/``decode_stats`` read the first worker of the role; ``worker_stats`` any
    worker by service name (``decode-1``, ...). ``is_idle`` checks every worker still running
    (a worker killed by a test holds nothing any more) and the pool.
    """

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.channels = {name: grpc.insecure_channel(address) for name, address in cluster.addresses.items()}
        self.pool = kv_pool_pb2_grpc.KVPoolStub(self.channels["kv_pool"])

    def pool_stats(self):
        return self.pool.GetStats(kv_pool_pb2.GetPoolStatsRequest(), timeout=5)

    def worker_stats(self, name: str):
        stub_type = (prefill_worker_pb2_grpc.PrefillWorkerStub if name.startswith("prefill")
                     else decode_worker_pb2_grpc.DecodeWorkerStub)
        return stub_type(self.channels[name]).GetStats(prefill_worker_pb2.GetWorkerStatsRequest(), timeout=5)

    def prefill_stats(self):
        return self.worker_stats("prefill")

    def decode_stats(self):
        return self.worker_stats("decode")

    def live_workers(self) -> list[str]:
        """Service names of the workers whose process is still running."""
        names = [n for n in self.cluster.addresses if n != "kv_pool"]
        return [n for n in names if self.cluster.service(n).process.poll() is None]

    def is_idle(self, exclude: frozenset[str] = frozenset()) -> Holdings:
        """Pool and running workers hold nothing (truthy); else what is held, by whom (its repr:
        a timed-out ``poll_until`` names it). ``exclude``: workers not asked (one restarting)."""
        pool = self.pool_stats()
        held = [f"kv_pool {f}={getattr(pool, f)}" for f in POOL_HOLDINGS if getattr(pool, f)]
        for name in sorted(set(self.live_workers()) - exclude):
            stats = self.worker_stats(name)
            held += [f"{name} {f}={getattr(stats, f)}" for f in WORKER_HOLDINGS if getattr(stats, f)]
        return Holdings(tuple(held))


POOL_HOLDINGS = ("num_leases", "num_leased_blocks", "num_scoped_blocks", "num_writing_blocks")
WORKER_HOLDINGS = ("num_used_blocks", "num_requests_running", "num_requests_waiting")


@dataclass(frozen=True)
class Holdings:
    """What the cluster holds (``"decode num_used_blocks=3"``, ...); truthy when nothing."""

    held: tuple[str, ...]

    def __bool__(self) -> bool:
        return not self.held

    def __repr__(self) -> str:
        return "idle" if not self.held else "held: " + ", ".join(self.held)


def pytest_collection_modifyitems(config, items):
    """Runs the end-to-end tests of the shared clusters first (those of ``cluster``, then those of
    ``colocated_cluster`` only; modules otherwise in their order): each shared cluster then stops
    before the modules that start clusters of their own, instead of idling beside them."""
    here = Path(__file__).parent
    positions = [i for i, item in enumerate(items) if here in item.path.parents]

    groups: dict[Path, int] = {}  # module -> its group: the first any of its tests belongs to
    for i in positions:
        names = items[i].fixturenames
        group = 0 if "cluster" in names else 1 if "colocated_cluster" in names else 2
        groups[items[i].path] = min(group, groups.get(items[i].path, 2))
    ordered = sorted((items[i] for i in positions), key=lambda item: groups[item.path])  # stable
    for i, item in zip(positions, ordered):
        items[i] = item


# Shared clusters by fixture name, while started: each is stopped after the last collected test
# that uses it (stop_shared_clusters), not at the session's end, so it does not run beside the
# clusters of the modules that follow.
_SHARED: dict[str, LocalCluster] = {}


def _shared_cluster(name: str, log_dir, **options):
    sizes = dict(block_size=BLOCK_SIZE, num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=512)
    config = ClusterConfig.from_options(model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(),
                                        log_dir=log_dir, **{**sizes, **options})
    with LocalCluster(config) as c:
        _SHARED[name] = c
        try:
            c.start()
            yield c
        finally:
            _SHARED.pop(name, None)


@pytest.fixture(autouse=True)
def stop_shared_clusters(request):
    """After a test: stops each shared cluster no later collected test uses (back_to_idle
    depends on it, so this teardown runs after that fixture's idle check; pytest sets up autouse
    fixtures of one scope in name order otherwise)."""
    yield
    if not _SHARED:
        return
    items = request.session.items
    later = items[items.index(request.node) + 1:] if request.node in items else []
    for name in list(_SHARED):
        if not any(name in item.fixturenames for item in later):
            _SHARED.pop(name).stop()


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """One prefill and one decode worker; 16-token blocks, 256 KV blocks, 1024 tokens of context,
    a 512-token step budget. These tests check the disaggregated path (pool hits, manifests): no
    conditional colocation of repeated prompts the decode worker already holds (docs/routing.md)."""
    yield from _shared_cluster("cluster", tmp_path_factory.mktemp("cluster-logs"), disaggregation="always")


@pytest.fixture(scope="session")
def colocated_cluster(tmp_path_factory):
    """One decode worker that prefills itself (no prefill worker), sized as ``cluster`` but for
    its 32-token step budget: every chat prompt (36 to 41 tokens) is prefilled in chunks mixed
    into the decode steps of the others."""
    yield from _shared_cluster("colocated_cluster", tmp_path_factory.mktemp("colocated-cluster-logs"),
                               colocated=True, max_num_batched_tokens=32)


@pytest.fixture(scope="session")
def probe(cluster) -> ClusterProbe:
    return ClusterProbe(cluster)


@pytest.fixture(autouse=True)
def back_to_idle(request, stop_shared_clusters):
    """After every e2e scenario: decode blocks, pool leases and scoped blocks back at idle."""
    yield
    if "probe" in request.fixturenames:
        probe = request.getfixturevalue("probe")
        poll_until(probe.is_idle, timeout_s=5, message="cluster back to idle")
