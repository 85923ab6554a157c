"""launcher.supervisor from plain numbers: the restart budget's window and backoff, and what the
supervisor does about each exit (fake services, a fake clock)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from launcher.supervisor import RestartBudget, RestartPolicy, ServiceExited, Supervisor


def test_budget_allows_max_restarts_per_sliding_window():
    budget = RestartBudget(RestartPolicy(max_restarts=5, window_s=60.0))
    for t in (0.0, 10.0, 20.0, 30.0, 40.0):
        assert budget.can_restart(t)
        budget.record(t)
    assert budget.num_recent(59.9) == 5 and not budget.can_restart(59.9)
    assert budget.num_recent(60.0) == 4 and budget.can_restart(60.0)  # the restart at 0 s left the window
    assert budget.num_recent(100.0) == 0


def test_backoff_doubles_per_recent_restart_up_to_the_cap():
    budget = RestartBudget(RestartPolicy(max_restarts=10, window_s=60.0, initial_backoff_s=0.5, max_backoff_s=8.0))
    backoffs = []
    for t in range(7):
        backoffs.append(budget.backoff_s(float(t)))
        budget.record(float(t))
    assert backoffs == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert budget.backoff_s(66.5) == 0.5  # every restart left the window: back to the start


@pytest.mark.parametrize(("field_name", "value", "message"), [
    ("max_restarts", -1, "max_restarts must be >= 0, got -1"),
    ("window_s", 0.0, "window_s must be > 0, got 0.0"),
    ("initial_backoff_s", -1.0, "initial_backoff_s must be > 0, got -1.0"),
])
def test_bad_policy_is_refused(field_name, value, message):
    with pytest.raises(ValueError, match=message):
        RestartPolicy(**{field_name: value})


@dataclass
class FakeService:
    name: str
    code: int | None = None
    healthy: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def log_location(self) -> str:
        return f"/logs/{self.name}.log"

    def exit_code(self) -> int | None:
        return self.code

    def ready(self) -> bool:
        return self.healthy

    def restart(self, note: str) -> None:
        self.notes.append(note)
        self.code, self.healthy = None, False


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_an_exited_worker_is_restarted_after_its_backoff_and_reported_healthy():
    clock = Clock()
    supervisor = Supervisor(RestartPolicy(), clock)
    decode, pool = FakeService("decode", code=-9), FakeService("kv_pool")
    assert supervisor.poll([decode, pool]) == [
        "decode exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s); see /logs/decode.log"]
    clock.now_s += 0.4
    assert supervisor.poll([decode, pool]) == [] and decode.notes == []  # backoff not over
    clock.now_s += 0.1
    assert supervisor.poll([decode, pool]) == ["decode restarted"]
    assert decode.notes == ["--- tandem up: restarting decode (restart 1 in 60 s) ---\n"]
    assert supervisor.poll([decode, pool]) == []  # running, not healthy yet
    decode.healthy = True
    assert supervisor.poll([decode, pool]) == ["decode is healthy again"]
    assert supervisor.poll([decode, pool]) == []


def test_the_sixth_exit_within_the_window_stops_the_cluster():
    clock = Clock()
    supervisor = Supervisor(RestartPolicy(max_restarts=5, window_s=60.0), clock)
    decode = FakeService("decode")
    for _ in range(5):
        decode.code = 1
        supervisor.poll([decode])
        clock.now_s += 8.0  # past the longest backoff
        assert supervisor.poll([decode]) == ["decode restarted"]
    decode.code = 1
    with pytest.raises(ServiceExited, match=r"^decode exited \(1\) after 5 restarts in the last 60 s; "
                                            r"stopping the cluster; see /logs/decode.log$"):
        supervisor.poll([decode])


def test_the_router_exiting_stops_the_cluster():
    with pytest.raises(ServiceExited, match=r"^router exited \(0\); the cluster cannot run without it"):
        Supervisor(RestartPolicy()).poll([FakeService("decode"), FakeService("router", code=0)])


def test_one_of_several_routers_is_restarted_like_a_worker():
    """tandem up --num-routers 2: no router is critical; the other keeps serving meanwhile."""
    clock = Clock()
    supervisor = Supervisor(RestartPolicy(), clock, critical=frozenset())
    router = FakeService("router-1", code=-9)
    assert supervisor.poll([FakeService("router-0"), router]) == [
        "router-1 exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s); see /logs/router-1.log"]
    clock.now_s += 0.5
    assert supervisor.poll([FakeService("router-0"), router]) == ["router-1 restarted"]
    assert router.notes == ["--- tandem up: restarting router-1 (restart 1 in 60 s) ---\n"]


def test_redis_exiting_is_restarted_like_a_worker():
    redis = FakeService("redis", code=-9)
    events = Supervisor(RestartPolicy()).poll([FakeService("decode"), redis])
    assert events == [f"redis exited (-9); restarting it in 0.5 s (restart 1 of at most 5 in 60 s); see {redis.log_location}"]


def test_no_restart_fails_fast():
    with pytest.raises(ServiceExited, match=r"^prefill exited \(-9\); restarts are off \(--no-restart\)"):
        Supervisor(RestartPolicy(max_restarts=0)).poll([FakeService("prefill", code=-9)])
