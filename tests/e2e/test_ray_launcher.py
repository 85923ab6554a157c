"""`tandem up --ray` on a local Ray instance: the services as Ray actors serve one real request with
the Hugging Face greedy output, the decode subprocess killed with -9 is restarted inside its actor
and serves it again, and stop() leaves no actor or service process behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest

from launcher.config import ClusterConfig

from launcher.ports import free_port
from tests import reference
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _completion(cluster) -> str | None:
    reply = httpx.post(
        f"{cluster.http_url}/v1/completions",
        json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
        timeout=120,
    )
    return reply.json()["choices"][0]["text"] if reply.status_code == 200 else None


def test_ray_cluster_serves_greedy_completion_and_stops_everything(tmp_path):
    pytest.importorskip("ray", reason="ray is not installed (pip install 'tandem-serve[ray]')")
    import ray

    from launcher.ray_cluster import RayCluster

    ids = reference.tokenizer()(PROMPT)["input_ids"]
    expected = reference.tokenizer().decode(reference.hf_greedy(ids, MAX_TOKENS))
    config = ClusterConfig.from_options(
        model="SmolLM2-135M-Instruct", http_port=free_port(), grpc_port=free_port(),
        num_kv_blocks=128, max_model_len=512, max_num_batched_tokens=512, log_dir=tmp_path,
    )
    cluster = RayCluster(config)
    started = time.monotonic()
    try:
        cluster.start(timeout_s=120, on_progress=lambda m: print(f"  {time.monotonic() - started:5.1f} s {m}"))
        assert {s.name for s in cluster.services} == {"kv_pool", "prefill", "decode", "router"}
        assert set(cluster.addresses) == {"kv_pool", "prefill", "decode"}
        pids = [p for s in cluster.services for p in (s.actor_pid, s.pid)]
        pids += [s.process.pid for s in cluster._redis.services]  # the launcher's private redis-server
        assert all(psutil.pid_exists(p) for p in pids)
        assert not cluster.use_gpus  # no GPU on this machine: workers placed by explicit CPU budgets
        reply = httpx.post(
            f"{cluster.http_url}/v1/completions",
            json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected
        assert cluster.dead_service() is None
        assert cluster.supervise() == []
        # Supervision: the decode subprocess killed with -9 is restarted inside its actor, same port.
        decode = next(s for s in cluster.services if s.name == "decode")
        old_pid, events = decode.pid, []
        os.kill(old_pid, signal.SIGKILL)
        poll_until(lambda: (events.extend(cluster.supervise()) or "decode is healthy again" in events)
                   and httpx.get(f"{cluster.http_url}/health", timeout=5).status_code == 200,
                   timeout_s=180, interval_s=0.2, message="decode restarted in its actor, healthy and routed to")
        assert events[1:] == ["decode restarted", "decode is healthy again"]
        assert events[0].startswith("decode exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s)")
        assert decode.pid != old_pid and psutil.Process(decode.pid).ppid() == decode.actor_pid
        pids.append(decode.pid)
        assert _completion(cluster) == expected
    finally:
        cluster.stop()
        print(f"ray cluster up, request and stop: {time.monotonic() - started:.1f} s")
    assert not ray.is_initialized()
    poll_until(lambda: all(_gone(p) for p in pids), timeout_s=15, message="every actor and service process gone")
    assert cluster.services == []
