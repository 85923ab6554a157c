"""One local cluster (real processes, real model) shared by the end-to-end tests."""

from __future__ import annotations

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

    def is_idle(self) -> bool:
        pool = self.pool_stats()
        if pool.num_leases or pool.num_leased_blocks or pool.num_scoped_blocks or pool.num_writing_blocks:
            return False
        for name in self.live_workers():
            stats = self.worker_stats(name)
            if stats.num_used_blocks or stats.num_requests_running or stats.num_requests_waiting:
                return False
        return True


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    config = ClusterConfig.from_options(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE,
        num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=512,
        log_dir=tmp_path_factory.mktemp("cluster-logs"),
        # These tests check the disaggregated path (pool hits, manifests): no conditional
        # colocation of repeated prompts the decode worker already holds (docs/routing.md).
        disaggregation="always",
    )
    with LocalCluster(config) as c:
        c.start()
        yield c


@pytest.fixture(scope="session")
def probe(cluster) -> ClusterProbe:
    return ClusterProbe(cluster)


@pytest.fixture(autouse=True)
def back_to_idle(request):
    """After every e2e scenario: decode blocks, pool leases and scoped blocks back at idle."""
    yield
    if "probe" in request.fixturenames:
        probe = request.getfixturevalue("probe")
        poll_until(probe.is_idle, timeout_s=5, message="cluster back to idle")
