"""router.workers.view with workers cut off from Redis while the router can still read it: a
worker whose registry key expired but that answers its health check SERVING stays in the view
(its heartbeats do not reach Redis; it serves); one that says NOT_SERVING (draining) or does not
answer leaves at once, as a deregistered worker did before.

Fakes: the registry of test_generation.py, a health probe by address, a fake loss clock.
"""

from __future__ import annotations

from core.registry import WorkerInfo
from router.workers.loss import LossWatch
from router.workers.view import Health, WorkerView
from tests.unit.router.test_generation import FakeRegistry, addresses, workers
from tests.unit.router.workers.test_loss import Clock, beat


class Probe:
    """Health by address (default SERVING); counts the checks of each address."""

    def __init__(self) -> None:
        self.health: dict[str, Health] = {}
        self.calls: dict[str, int] = {}

    async def __call__(self, address: str) -> Health:
        self.calls[address] = self.calls.get(address, 0) + 1
        return self.health.get(address, Health.SERVING)


async def view_with_probe(num_decode: int = 2) -> tuple[WorkerView, FakeRegistry, Probe]:
    registry = FakeRegistry(workers(1, num_decode))
    probe = Probe()
    # No periodic sweep (its clock is time.monotonic(), which the fake clock does not move): only the
    # checks of the rules under test are counted
    view = WorkerView(registry, probe=probe, health_interval_s=float("inf"), loss=LossWatch(5.0, Clock()))
    await view.refresh()
    return view, registry, probe


def cut_from_redis(registry: FakeRegistry, cut: set[str]) -> None:
    """One heartbeat interval: the workers in ``cut`` cannot write their entry (it expired), the
    others beat."""
    registry.workers = [w for w in registry.workers if w.address not in cut]
    for w in registry.workers:
        beat(registry, w.address)


async def heal(view: WorkerView, registry: FakeRegistry, listed: list[WorkerInfo], elapsed_s: float) -> None:
    """The partition ends: every worker of ``listed`` is in the registry again and beats; the view
    refreshes ``elapsed_s`` later."""
    registry.workers = listed
    for w in listed:
        beat(registry, w.address)
    view.loss.clock.now_s += elapsed_s
    await view.refresh()


async def test_every_decode_worker_cut_from_redis_stays_routable_while_it_serves():
    """The campaign's "decode workers cut from Redis": both decode keys expired, the prefill
    worker and the pool still beat. Before, both decode workers left the view (503 no_worker)."""
    view, registry, probe = await view_with_probe()
    listed = list(registry.workers)
    cut_from_redis(registry, {"decode:0", "decode:1"})
    view.loss.clock.now_s += 1.0
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"] and addresses(view, "prefill") == ["prefill:0"]
    assert (probe.calls["decode:0"], probe.calls["decode:1"]) == (1, 1)
    for _ in range(3):  # the partition lasts: past the loss bound, spared as each answers SERVING
        cut_from_redis(registry, set())
        view.loss.clock.now_s += 2.0
        await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]
    assert not view.loss.lost_event("decode:0").is_set()
    await heal(view, registry, listed, elapsed_s=1.0)
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_a_worker_gone_from_the_registry_that_says_not_serving_leaves_at_once():
    """A draining worker reports NOT_SERVING before it deregisters: it leaves, as before; and it
    is asked once, not at every refresh while it stays gone."""
    view, registry, probe = await view_with_probe()
    probe.health["decode:0"] = Health.NOT_SERVING
    cut_from_redis(registry, {"decode:0"})
    view.loss.clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"]
    view.loss.clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"] and probe.calls["decode:0"] == 1


async def test_a_worker_gone_from_the_registry_that_does_not_answer_leaves_and_is_lost():
    view, registry, probe = await view_with_probe()
    probe.health["decode:1"] = Health.UNKNOWN  # hung, or cut off from the router too
    event = view.loss.lost_event("decode:1")
    cut_from_redis(registry, {"decode:1"})
    view.loss.clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0"]
    cut_from_redis(registry, set())
    view.loss.clock.now_s += 5.0
    await view.refresh()
    assert event.is_set() and addresses(view, "decode") == ["decode:0"]


async def test_a_kept_worker_that_fails_stays_down_until_its_heartbeats_return():
    """Kept while cut from Redis, then marked down by a failed RPC: it is not forgotten and
    brought back by the next probe; only a heartbeat after the failure (and SERVING) does."""
    view, registry, probe = await view_with_probe()
    listed = list(registry.workers)
    cut_from_redis(registry, {"decode:0"})
    view.loss.clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]
    view.mark_down("decode:0", "decode worker failed (UNAVAILABLE)")
    for _ in range(2):
        cut_from_redis(registry, set())
        view.loss.clock.now_s += 0.5
        await view.refresh()
        assert addresses(view, "decode") == ["decode:1"]
    await heal(view, registry, listed, elapsed_s=0.5)
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_without_a_health_probe_a_worker_gone_from_the_registry_leaves():
    registry = FakeRegistry(workers(1, 2))
    view = WorkerView(registry, loss=LossWatch(5.0, Clock()))
    await view.refresh()
    cut_from_redis(registry, {"decode:0"})
    view.loss.clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"]
