"""LeastLoadedPolicy from plain WorkerInfo values."""

from __future__ import annotations

import pytest

from core.registry import WorkerInfo
from router.routing import InFlightCounter, LeastLoadedPolicy, RoutingRequest

REQUEST = RoutingRequest("req-1", [1, 2, 3])


def worker(worker_id: str, running: int = 0, waiting: int = 0, free_blocks: int = 100) -> WorkerInfo:
    load = {"num_requests_running": running, "num_requests_waiting": waiting,
            "num_free_blocks": free_blocks, "num_total_blocks": 100}
    return WorkerInfo(worker_id, "decode", f"127.0.0.1:{9000 + int(worker_id[1:])}", load)


def test_fewest_running_plus_waiting_wins() -> None:
    policy = LeastLoadedPolicy(InFlightCounter())
    workers = [worker("w1", running=3, waiting=0), worker("w2", running=1, waiting=1), worker("w3", running=0, waiting=4)]
    assert policy.choose(workers, REQUEST).worker_id == "w2"


def test_own_in_flight_requests_count() -> None:
    in_flight = InFlightCounter()
    policy = LeastLoadedPolicy(in_flight)
    w1, w2 = worker("w1", running=1), worker("w2", running=2)
    with in_flight.track(w1.address), in_flight.track(w1.address):
        assert policy.load(w1) == 3
        assert policy.choose([w1, w2], REQUEST).worker_id == "w2"
    assert in_flight.get(w1.address) == 0
    assert policy.choose([w1, w2], REQUEST).worker_id == "w1"


def test_ties_go_to_more_free_blocks_then_worker_id() -> None:
    policy = LeastLoadedPolicy(InFlightCounter())
    assert policy.choose([worker("w1", free_blocks=10), worker("w2", free_blocks=50)], REQUEST).worker_id == "w2"
    assert policy.choose([worker("w2"), worker("w1")], REQUEST).worker_id == "w1"


def test_missing_load_fields_count_as_zero() -> None:
    policy = LeastLoadedPolicy(InFlightCounter())
    bare = WorkerInfo("w9", "prefill", "127.0.0.1:1")
    assert policy.choose([worker("w1", running=1), bare], REQUEST) is bare


def test_no_workers_raises() -> None:
    with pytest.raises(ValueError, match="req-1"):
        LeastLoadedPolicy(InFlightCounter()).choose([], REQUEST)
