"""LocalCluster supervision (launcher.supervisor), real processes and the real model: the decode
worker killed with -9 is restarted with the same flags and port while every other process keeps
running, the router takes it back, the cluster answers with the Hugging Face greedy tokens, and
stop() leaves no process behind."""

from __future__ import annotations

import os
import signal
import socket

import httpx
import psutil
import pytest
import redis

from core.registry import worker_key
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from launcher.supervisor import RestartPolicy
from tandem.v1 import common_pb2
from tests import reference
from tests.conftest import poll_until
from tests.e2e.test_cluster import grpc_generate

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _router_healthy(cluster: LocalCluster) -> bool:
    try:
        return httpx.get(f"{cluster.http_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_killed_decode_worker_is_restarted_on_its_port_and_serves_the_greedy_answer(tmp_path):
    ids = reference.tokenizer()(PROMPT)["input_ids"]
    expected = reference.hf_greedy(ids, MAX_TOKENS)
    config = ClusterConfig.from_options(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(), num_kv_blocks=128,
        max_model_len=512, max_num_batched_tokens=512, log_dir=tmp_path,
        restart=RestartPolicy(initial_backoff_s=0.1),
    )
    cluster = LocalCluster(config)
    processes: list[psutil.Process] = []
    try:
        cluster.start(timeout_s=300)
        decode = cluster.service("decode")
        old_pid, argv = decode.process.pid, list(decode.process.args)
        others = {s.name: s.process.pid for s in cluster.services if s.name != "decode"}
        rdb = redis.Redis.from_url(cluster.redis_url)
        host = socket.gethostname()
        assert rdb.exists(worker_key("decode", f"decode-{host}-{old_pid}"))
        os.kill(old_pid, signal.SIGKILL)

        events: list[str] = []

        def restarted_registered_and_routed() -> bool:
            events.extend(cluster.supervise())
            pid = decode.process.pid
            return (pid != old_pid and decode.exit_code() is None
                    and bool(rdb.exists(worker_key("decode", f"decode-{host}-{pid}")))
                    and decode.ready() and _router_healthy(cluster))

        poll_until(restarted_registered_and_routed, timeout_s=180, interval_s=0.2,
                   message="a new decode worker registered, healthy and routed to")
        assert events[:2] == [
            f"decode exited (-9); restarting it in 0.1 s (restart 1 of at most 5 in 60 s); see {decode.log_path}",
            "decode restarted",
        ]
        assert list(decode.process.args) == argv  # same flags, same --port
        assert {s.name: s.process.pid for s in cluster.services if s.name != "decode"} == others

        tokens, _, finished = grpc_generate(
            cluster, text=PROMPT, sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
        assert tokens == expected
        assert finished.usage.completion_tokens == len(expected)
        assert cluster.supervise() == []  # the request changed nothing: no new exit

        log_text = decode.log_path.read_text(errors="replace")
        before, note, _ = log_text.partition("--- tandem up: restarting decode (restart 1 in 60 s) ---\n")
        assert note and before.strip(), "the first process's log is kept, the restart appended"
        rdb.close()
        processes = [psutil.Process(s.process.pid) for s in cluster.services]
        processes += [c for p in processes for c in p.children(recursive=True)]
    finally:
        cluster.stop()
    assert cluster.services == []
    poll_until(lambda: all(_gone(p) for p in processes), timeout_s=15, message="every cluster process gone")
