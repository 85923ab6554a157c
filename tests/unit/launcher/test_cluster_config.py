"""ClusterConfig's worker counts: names, thread budgets, bad values."""

from __future__ import annotations

import pytest

from launcher.commands import SHARED_CORES_MIXED_PREFILL_TOKENS, core_share_argv, shared_threads, worker_threads
from launcher.config import ClusterConfig


def test_two_by_two_worker_names_in_start_order():
    config = ClusterConfig.from_options(model="m", num_prefill_workers=2, num_decode_workers=2)
    assert config.worker_names == (("prefill", "prefill"), ("prefill-1", "prefill"),
                                   ("decode", "decode"), ("decode-1", "decode"))


def test_colocated_starts_decode_workers_only():
    config = ClusterConfig.from_options(model="m", colocated=True, num_prefill_workers=3, num_decode_workers=2)
    assert config.worker_names == (("decode", "decode"), ("decode-1", "decode"))


def test_threads_are_split_per_worker():
    assert worker_threads(16, num_prefill_workers=2, num_decode_workers=4) == {"prefill": 4, "decode": 2}
    assert worker_threads(2, num_prefill_workers=2, num_decode_workers=2) == {"prefill": 1, "decode": 1}
    assert worker_threads(8, colocated=True, num_decode_workers=3) == {"decode": 2}


def test_disaggregated_roles_never_share_a_core():
    """Threads of all workers together never exceed the cores (a shared core stalls OpenMP
    barriers); colocated takes every core."""
    assert worker_threads(2) == {"prefill": 1, "decode": 1}
    assert worker_threads(3) == {"prefill": 1, "decode": 2}
    assert worker_threads(4, num_prefill_workers=2) == {"prefill": 1, "decode": 2}
    assert worker_threads(8) == {"prefill": 4, "decode": 4}
    assert worker_threads(2, colocated=True) == {"decode": 2}


def test_a_decode_worker_borrows_the_cores_it_does_not_own():
    """engine.core_share: the extra threads are the cores outside the decode workers' own;
    off when disabled, colocated, or tensor-parallel."""
    def extra(cores, **options):
        config = ClusterConfig.from_options(model="m", **options)
        threads = worker_threads(cores, config.colocated, config.num_prefill_workers, config.num_decode_workers)
        return shared_threads(cores, threads, config)

    assert extra(2) == 1
    assert extra(8) == 4
    assert extra(4, num_decode_workers=2) == 2  # decode 1 + 1, prefill 2: one borrower at a time adds 2
    assert extra(4, num_prefill_workers=2) == 2
    assert extra(2, share_cores=False) == 0
    assert extra(2, colocated=True) == 0
    assert extra(4, prefill_tp=2) == 0
    assert extra(4, decode_tp=2) == 0


def test_a_decode_worker_sharing_cores_caps_the_prompt_tokens_beside_its_decodes():
    """Sharing one machine's cores, the decode worker takes at most SHARED_CORES_MIXED_PREFILL_TOKENS
    prompt tokens into a step beside decodes unless the cluster sets --max-mixed-prefill-tokens;
    the prefill worker gets the directory alone; without sharing, no flags."""
    config = ClusterConfig.from_options(model="m")
    assert core_share_argv(config, "decode", "/d", 1) == [
        "--core-share-dir", "/d", "--core-share-threads", "1",
        "--max-mixed-prefill-tokens", str(SHARED_CORES_MIXED_PREFILL_TOKENS)]
    assert core_share_argv(config, "prefill", "/d", 1) == ["--core-share-dir", "/d"]
    assert core_share_argv(config, "decode", "", 0) == []
    own = ClusterConfig.from_options(model="m", max_mixed_prefill_tokens=32)
    assert core_share_argv(own, "decode", "/d", 1) == ["--core-share-dir", "/d", "--core-share-threads", "1"]


def test_routers_are_named_and_given_consecutive_ports():
    assert ClusterConfig.from_options(model="m").router_names == ("router",)
    config = ClusterConfig.from_options(model="m", http_port=8000, grpc_port=50050, num_routers=2)
    assert config.router_names == ("router-0", "router-1")
    assert [config.router_ports(n) for n in config.router_names] == [(8000, 50050), (8001, 50051)]
    with pytest.raises(ValueError, match="no router 'router'"):
        config.router_ports("router")


def test_router_port_ranges_must_not_overlap():
    with pytest.raises(ValueError, match=r"HTTP ports 8000-8002 and gRPC ports 8002-8004 overlap"):
        ClusterConfig.from_options(model="m", http_port=8000, grpc_port=8002, num_routers=3)
    ClusterConfig.from_options(model="m", http_port=8000, grpc_port=8002, num_routers=2)  # 8000-8001 and 8002-8003
    with pytest.raises(ValueError, match=r"num_routers=2 needs http_port and grpc_port > 0"):
        ClusterConfig.from_options(model="m", http_port=0, grpc_port=50050, num_routers=2)


def test_a_local_cluster_lists_every_router_and_its_metrics(tmp_path):
    from launcher.local_cluster import LocalCluster

    cluster = LocalCluster(ClusterConfig.from_options(model="m", http_port=9000, grpc_port=51000, num_routers=2, log_dir=tmp_path))
    assert [(r.name, r.http_url, r.grpc_address) for r in cluster.routers] == [
        ("router-0", "http://127.0.0.1:9000", "127.0.0.1:51000"), ("router-1", "http://127.0.0.1:9001", "127.0.0.1:51001")]
    assert cluster.http_url == "http://127.0.0.1:9000"
    assert cluster.metrics_urls == {"router-0": "http://127.0.0.1:9000/metrics", "router-1": "http://127.0.0.1:9001/metrics"}


def test_free_port_run_finds_consecutive_free_ports():
    import socket

    from launcher.ports import free_port_run

    first = free_port_run(3)
    for port in range(first, first + 3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.parametrize("field", ["num_prefill_workers", "num_decode_workers", "num_routers"])
def test_zero_workers_is_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        ClusterConfig.from_options(model="m", **{field: 0})



def test_tensor_parallel_workers_split_their_threads_between_ranks():
    from launcher.commands import service_argv

    config = ClusterConfig.from_options(model="m", prefill_tp=2, decode_tp=1)
    assert (config.rank_threads("prefill", 1), config.rank_threads("decode", 2)) == (1, 2)
    assert ClusterConfig.from_options(model="m", decode_tp=2).rank_threads("decode", 2) == 1  # 2 cores: a thread a rank
    argv = service_argv(config, "prefill", "py", "127.0.0.1", 5000, "redis://x", num_threads=4)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--num-threads") + 1] == "2"
    decode = service_argv(config, "decode", "py", "127.0.0.1", 5001, "redis://x", num_threads=2)
    assert decode[decode.index("--tensor-parallel-size") + 1] == "1"


@pytest.mark.parametrize("field", ["prefill_tp", "decode_tp"])
def test_zero_tensor_parallel_size_is_refused(field):
    with pytest.raises(ValueError, match=f"{field} must be >= 1, got 0"):
        ClusterConfig.from_options(model="m", **{field: 0})


def test_the_banner_lists_every_router(tmp_path):
    from tandem_cli.up import _api_line
    from launcher.local_cluster import LocalCluster

    one = LocalCluster(ClusterConfig.from_options(model="m", http_port=8000, grpc_port=50050, log_dir=tmp_path))
    assert _api_line(one) == "OpenAI API http://127.0.0.1:8000/v1  gRPC 127.0.0.1:50050"
    two = LocalCluster(ClusterConfig.from_options(model="m", http_port=8000, grpc_port=50050, num_routers=2, log_dir=tmp_path))
    assert _api_line(two) == ("routers: router-0 OpenAI API http://127.0.0.1:8000/v1 gRPC 127.0.0.1:50050; "
                              "router-1 OpenAI API http://127.0.0.1:8001/v1 gRPC 127.0.0.1:50051")
