"""One local cluster (real processes, real model) shared by the end-to-end tests."""

from __future__ import annotations

import grpc
import pytest

from launcher.local_cluster import ClusterConfig, LocalCluster, free_port
from tandem.v1 import decode_worker_pb2_grpc, kv_pool_pb2, kv_pool_pb2_grpc, prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.conftest import poll_until

BLOCK_SIZE = 16


class ClusterProbe:
    """Reads the cluster's state through its stats RPCs (never through internals)."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        ch = {name: grpc.insecure_channel(address) for name, address in cluster.addresses.items()}
        self.pool = kv_pool_pb2_grpc.KVPoolStub(ch["kv_pool"])
        self.prefill = prefill_worker_pb2_grpc.PrefillWorkerStub(ch["prefill"])
        self.decode = decode_worker_pb2_grpc.DecodeWorkerStub(ch["decode"])

    def pool_stats(self):
        return self.pool.GetStats(kv_pool_pb2.GetPoolStatsRequest(), timeout=5)

    def prefill_stats(self):
        return self.prefill.GetStats(prefill_worker_pb2.GetWorkerStatsRequest(), timeout=5)

    def decode_stats(self):
        return self.decode.GetStats(prefill_worker_pb2.GetWorkerStatsRequest(), timeout=5)

    def is_idle(self) -> bool:
        pool, decode, prefill = self.pool_stats(), self.decode_stats(), self.prefill_stats()
        return (
            decode.num_used_blocks == 0 and decode.num_requests_running == 0 and decode.num_requests_waiting == 0
            and prefill.num_used_blocks == 0
            and pool.num_leases == 0 and pool.num_leased_blocks == 0
            and pool.num_scoped_blocks == 0 and pool.num_writing_blocks == 0
        )


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    config = ClusterConfig(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE,
        num_kv_blocks=256, max_model_len=1024, max_num_batched_tokens=512,
        log_dir=tmp_path_factory.mktemp("cluster-logs"),
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
