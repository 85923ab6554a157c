"""LeaseKeeper with a fake pool client: no RPC for reads that end in time, a renewal for reads
that run long, LeaseLostError when the pool let the lease go."""

from __future__ import annotations

import time

import grpc
import pytest

from engine.kv_connector.lease_keeper import LeaseKeeper, LeaseLostError


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class FakeClient:
    """Holds one lease id per request, as the pool's LeaseTable does."""

    address = "pool:1"

    def __init__(self, held: dict[str, int]):
        self.held = held
        self.calls: list[tuple[str, int, float]] = []
        self.broken = False

    def renew_lease(self, request_id: str, lease_id: int, ttl_s: float) -> bool:
        self.calls.append((request_id, lease_id, ttl_s))
        if self.broken:
            raise grpc.RpcError()
        current = self.held.get(request_id, 0)
        return current != 0 and lease_id in (0, current)


def test_a_read_that_ends_in_time_costs_no_rpc():
    clock, client = FakeClock(), FakeClient({"r": 7})
    keeper = LeaseKeeper(ttl_s=60, clock=clock)
    watch = keeper.watch("r", client)
    clock.now_s += 19.9  # before renew_after (1/3) x 60 s: the renewal thread has nothing to do yet
    keeper.finish(watch, lease_id=7)
    assert client.calls == [] and keeper.num_lost == 0
    keeper.close()


def test_a_late_read_asks_the_pool_once_and_passes_while_its_lease_holds():
    clock, client = FakeClock(), FakeClient({"r": 7})
    keeper = LeaseKeeper(ttl_s=60, clock=clock)
    watch = keeper.watch("r", client)
    clock.now_s += 48.0
    keeper.finish(watch, lease_id=7)
    # The proof names the read's lease (the renewal thread may have kept it alive before).
    assert client.calls[-1] == ("r", 7, 60) and keeper.num_lost == 0
    keeper.close()


def test_a_read_whose_lease_is_gone_or_replaced_fails():
    clock, client = FakeClock(), FakeClient({"r": 7})
    keeper = LeaseKeeper(ttl_s=60, clock=clock)
    watch = keeper.watch("r", client)
    clock.now_s += 61
    client.held["r"] = 8  # lapsed, and the request leased again since: another lease
    with pytest.raises(LeaseLostError, match="did not hold until its read ended"):
        keeper.finish(watch, lease_id=7)
    watch = keeper.watch("r", client)
    clock.now_s += 61
    client.broken = True  # the pool cannot say: the lease is not proven
    with pytest.raises(LeaseLostError):
        keeper.finish(watch, lease_id=8)
    assert keeper.num_lost == 2
    keeper.close()


def test_the_renewal_thread_renews_a_long_read_and_stops_after_it():
    client = FakeClient({"r": 3})
    keeper = LeaseKeeper(ttl_s=0.3)  # renews every 0.1 s of a running read
    watch = keeper.watch("r", client)
    deadline = time.monotonic() + 10
    while watch.num_renewals < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert watch.num_renewals >= 3
    assert client.calls[0] == ("r", 0, 0.3)  # before the read's LocateBlocks answered: "whichever it holds"
    time.sleep(0.3)  # the read runs on past its ttl
    keeper.finish(watch, lease_id=3)  # kept alive, then proven under its own id
    assert client.calls[-1] == ("r", 3, 0.3) and keeper.num_lost == 0
    num_calls = len(client.calls)
    time.sleep(0.35)  # no watch left: nothing renewed any more (this sleep only waits for a non-event)
    assert len(client.calls) in (num_calls, num_calls + 1)  # at most one renewal racing the finish
    keeper.close()


def test_bad_fractions_are_refused():
    with pytest.raises(ValueError, match="ttl_s must be > 0, got 0"):
        LeaseKeeper(ttl_s=0)
    with pytest.raises(ValueError, match="need 0 < renew_after < safety <= 1"):
        LeaseKeeper(ttl_s=1, renew_after=0.9, safety=0.8)
