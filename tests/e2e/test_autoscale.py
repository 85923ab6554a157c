"""`tandem up --autoscale` on a real local cluster: a load step (rate x 4, then back) scales the
decode workers up and back down, the new worker answers requests while it is up, and every
request is answered in full."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from autoscaler.local import LocalAutoscaler
from autoscaler.policy import AutoscaleConfig
from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import decode_worker_pb2_grpc, prefill_worker_pb2
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPT = list(range(1000, 1199))  # 1 + 199 prompt tokens + 8 outputs = 13 blocks of 16; the cache (28) holds 2
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    config = ClusterConfig.from_options(model=MODEL, http_port=free_port(), grpc_port=free_port(), num_kv_blocks=28,
                           max_num_seqs=8, max_model_len=256, max_num_batched_tokens=256, colocated=True,
                           log_dir=tmp_path_factory.mktemp("autoscale-logs"),
                           enable_prefix_caching=False)
    with LocalCluster(config) as c:
        c.start()
        yield c


class Load:
    """Requests at ``rate_per_s`` (changed on the fly) from a thread, at most ``max_in_flight``
    outstanding (an arrival due beyond that waits for a reply); every reply kept.

    The cap keeps the step's backlog small: uncapped, the step sent ~130 requests while the second
    worker started, and draining them took ~100 s of the test. Four in flight still hold twice
    the KV cache of one worker (two requests fill it), which is what the autoscaler reacts to."""

    def __init__(self, url: str, max_in_flight: int = 4):
        self.url, self.rate_per_s, self.replies, self._stop = url, 0.0, [], threading.Event()
        self._threads: list[threading.Thread] = []
        self._sender = threading.Thread(target=self._send_loop, daemon=True)
        self._slots = threading.BoundedSemaphore(max_in_flight)

    def one(self, index: int) -> None:
        # A first token of its own (3..992: past the special ids 1 and 2): no request finds another's
        # blocks in the pool, so each computes its whole prompt and holds its 13 blocks as long as
        # its own service time (pool hits of 192 of 200 tokens made requests several times
        # shorter than the first one, whose latency sets the rates).
        body = {"model": MODEL, "prompt": [3 + index % 990, *PROMPT], "max_tokens": MAX_TOKENS, "ignore_eos": True}
        try:
            reply = httpx.post(f"{self.url}/v1/completions", json=body, timeout=600)
            self.replies.append((reply.status_code, reply.json()["usage"]["completion_tokens"]))
        except Exception as err:  # recorded, so the test names what failed
            self.replies.append((repr(err), 0))
        finally:
            self._slots.release()

    def _send_loop(self) -> None:
        index, last_s = 0, float("-inf")
        while not self._stop.is_set():
            if self.rate_per_s > 0 and time.monotonic() - last_s >= 1.0 / self.rate_per_s \
                    and self._slots.acquire(blocking=False):
                thread = threading.Thread(target=self.one, args=(index,), daemon=True)
                thread.start()
                self._threads.append(thread)
                index, last_s = index + 1, time.monotonic()
            self._stop.wait(0.05)  # the arrival schedule's tick (a rate change applies at once)

    def start(self) -> None:
        self._sender.start()

    def finish(self, timeout_s: float = 600) -> None:
        self._stop.set()
        self._sender.join(timeout_s)
        for thread in self._threads:
            thread.join(timeout_s)


def worker_stats(cluster: LocalCluster, name: str):
    """A decode worker's GetStats reply (its own counters, not the router's view)."""
    with grpc.insecure_channel(cluster.addresses[name]) as channel:
        return decode_worker_pb2_grpc.DecodeWorkerStub(channel).GetStats(prefill_worker_pb2.GetWorkerStatsRequest(),
                                                                         timeout=10)


def run_until(scaler: LocalAutoscaler, condition, timeout_s: float, what: str) -> None:
    """Runs autoscaler evaluations on this thread (it started the cluster) until ``condition()``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} within {timeout_s:.0f} s; evaluations {scaler.history[-30:]}")
        scaler.step()
        time.sleep(0.2)  # pacing the evaluation loop, not synchronising


@pytest.mark.timeout(1800)  # two worker start-ups and drains on a shared 2-core machine
def test_a_load_step_scales_decode_up_and_back_down_answering_every_request(cluster):
    started = time.monotonic()
    httpx.post(f"{cluster.http_url}/v1/completions", timeout=600,
               json={"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True})
    latency_s = time.monotonic() - started  # one request alone: the worker's service time
    # SLOs loose enough that only the KV cache fills up: one request holds 13 of 28 blocks (pressure
    # 13 / 28 / 0.85 = 0.55), two hold 26 (1.09).
    # One evaluation over the threshold scales up: with 4 requests in flight the cache holds one or
    # two of them from moment to moment (each finishes in ~0.6 s on a fast worker), and three
    # consecutive samples at two took minutes in a fresh-clone CI run (the hysteresis itself is
    # tested in tests/unit/autoscaler). The base rate never overlaps two requests.
    config = AutoscaleConfig(ttft_slo_s=600.0, tbt_slo_s=600.0, min_prefill=0, max_prefill=0, min_decode=1,
                             max_decode=2, up_evaluations=1, down_evaluations=4, cooldown_s=5.0, kv_usage_high=0.85)
    scaler = LocalAutoscaler(cluster, config, interval_s=1.0)
    decode_workers = lambda: len(cluster.worker_services("decode"))  # noqa: E731
    load = Load(cluster.http_url)
    base_rate_per_s = 0.5 / latency_s  # one request at a time, half the time
    load.rate_per_s = base_rate_per_s
    load.start()
    try:
        base_until = time.monotonic() + 1.5 / base_rate_per_s  # two base-rate arrivals
        run_until(scaler, lambda: time.monotonic() > base_until, 600, "")
        assert decode_workers() == 1, scaler.history
        # The step: as many requests as the cap lets in (4 in flight), so that they overlap and
        # fill the KV cache whatever the service time (a 4x rate step kept one request at a time
        # once the kernels got faster, and the autoscaler saw no pressure for 8 minutes).
        load.rate_per_s = 1000.0
        run_until(scaler, lambda: decode_workers() == 2, 600, "no second decode worker")
        run_until(scaler, lambda: len(scaler.read_live("decode")) == 2, 300, "the new worker never registered")
        new_worker = cluster.worker_services("decode")[-1].name
        # The step lasts until the new worker has generated a request's worth of tokens itself
        # (its calibration passes bypass the served engine's counter): with the first worker busy,
        # the router prefers the idle one once its registry view (0.5 s refresh) holds it.
        generated = lambda: worker_stats(cluster, new_worker).num_generated_tokens  # noqa: E731
        run_until(scaler, lambda: generated() >= MAX_TOKENS, 300, f"{new_worker} answered no request")
        load.rate_per_s = base_rate_per_s  # and back
        back_until = time.monotonic() + 1.5 / base_rate_per_s
        run_until(scaler, lambda: time.monotonic() > back_until, 600, "")
        load.finish()  # every request sent so far answered
        run_until(scaler, lambda: decode_workers() == 1, 300, "decode did not scale back down")
        run_until(scaler, lambda: not cluster.draining(), 300, "the drained worker did not exit")
    finally:
        load.finish()
    assert len(load.replies) >= 5, load.replies
    assert all(reply == (200, MAX_TOKENS) for reply in load.replies), load.replies
    (remaining,) = [s.name for s in cluster.worker_services("decode")]
    assert remaining != new_worker  # the newest worker is the one drained

    def held() -> tuple[int, int, int]:  # (used KV blocks, running, waiting): prefix caching is off
        stats = worker_stats(cluster, remaining)
        return stats.num_used_blocks, stats.num_requests_running, stats.num_requests_waiting

    poll_until(lambda: held() == (0, 0, 0), timeout_s=30, interval_s=0.5, message=f"{remaining} idle after the load")
