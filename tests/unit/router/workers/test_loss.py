"""Hung workers: a worker whose heartbeat stops is lost, and the calls waiting on it
fail over; a worker that only vanished from the registry (Redis restarted) is kept.

The fakes of test_generation.py stand in for workers; the fake decode stream here hangs after some
tokens the way a SIGSTOPped worker's does (no message, no error), and a fake clock moves time.
"""

from __future__ import annotations

import asyncio

import pytest

from core.registry import WorkerInfo
from core.request import FinishReason
from router.workers.clients import DecodeTokens
from router.workers.loss import LossWatch, stream_unless_lost, unless_lost
from router.errors import WorkerFailedError
from router.workers.view import Health, WorkerView
from tests.unit.router.test_generation import POOL, FakeClients, FakeRegistry, FakeStream, addresses, counter, make_generation, run, workers


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def beat(registry: FakeRegistry, address: str) -> None:
    for w in registry.workers:
        if w.address == address:
            w.heartbeat_time_s += 1.0


async def view_with_clock(num_decode: int = 2):
    clock = Clock()
    registry = FakeRegistry(workers(1, num_decode))
    view = WorkerView(registry, loss=LossWatch(5.0, clock))
    await view.refresh()
    return view, registry, clock


async def test_a_worker_whose_heartbeat_stops_is_lost_after_the_bound():
    view, registry, clock = await view_with_clock()
    event = view.loss.lost_event("decode:0")
    clock.now_s += 4.0
    beat(registry, "decode:1")  # decode:0's heartbeat does not move
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"] and not event.is_set()
    clock.now_s += 1.5  # 5.5 s without a heartbeat from decode:0, 1.5 s since decode:1's
    await view.refresh()
    assert event.is_set() and addresses(view, "decode") == ["decode:1"]
    await view.refresh()  # its stale entry, still listed, does not bring it back
    assert addresses(view, "decode") == ["decode:1"]
    beat(registry, "decode:0")  # it woke up (SIGCONT) and beats again
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]
    assert not view.loss.lost_event("decode:0").is_set()  # a successor at that address starts afresh


async def test_a_worker_that_vanished_from_the_registry_stays_until_the_bound():
    """Redis restarted with its data lost: every key is gone until the workers beat again."""
    view, registry, clock = await view_with_clock()
    listed = registry.workers
    registry.workers = []
    clock.now_s += 1.0
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"] and addresses(view, "prefill") == ["prefill:0"]
    registry.workers = listed
    for w in listed:
        w.heartbeat_time_s += 1.0  # re-registered by their next heartbeat
    clock.now_s += 4.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


def reregistered(listed: list[WorkerInfo], addresses: set[str]) -> list[WorkerInfo]:
    """The registry right after Redis came back empty: only the workers in ``addresses`` beat again."""
    out = [w for w in listed if w.address in addresses]
    for w in out:
        w.heartbeat_time_s += 1.0
    return out


async def test_the_first_read_after_redis_was_down_keeps_workers_not_yet_reregistered():
    """The campaign's "Redis down 8 s" 503s: Redis came back empty and the first good read found
    the pool and a prefill worker re-registered but neither decode worker yet; they left the view
    and requests got 503 no_worker until their next heartbeats."""
    view, registry, clock = await view_with_clock()
    listed = registry.workers

    async def refused(role):
        raise ConnectionError("Error 111 connecting to redis")

    registry.list_workers, readable = refused, registry.list_workers
    for _ in range(3):
        clock.now_s += 0.5
        with pytest.raises(ConnectionError):
            await view.refresh()
    registry.list_workers, registry.run_id = readable, "redis-2"
    registry.workers = reregistered(listed, {"prefill:0", POOL})
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"] and addresses(view, "prefill") == ["prefill:0"]
    registry.workers = listed  # the rest beat too
    for w in listed:
        w.heartbeat_time_s += 1.0
    clock.now_s += 1.0
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_a_redis_restart_between_two_reads_is_told_by_its_run_id():
    """No read failed (Redis restarted within one refresh interval), but another run_id says its
    data may be gone: the decode worker that has not beaten yet stays."""
    view, registry, clock = await view_with_clock()
    listed = registry.workers
    registry.run_id = "redis-2"
    registry.workers = reregistered(listed, {"prefill:0", "decode:1", POOL})
    clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:0", "decode:1"]


async def test_a_worker_gone_from_an_unchanged_redis_leaves_at_once():
    """Same Redis, no failed read: a missing entry is a worker that deregistered (drained)."""
    view, registry, clock = await view_with_clock()
    registry.workers = [w for w in registry.workers if w.address != "decode:0"]
    clock.now_s += 0.5
    await view.refresh()
    assert addresses(view, "decode") == ["decode:1"]


async def test_an_unreadable_registry_pauses_the_loss_clock():
    view, registry, clock = await view_with_clock()

    async def broken(role):
        raise ConnectionError("redis down")

    readable = registry.list_workers
    registry.list_workers = broken
    clock.now_s += 30.0
    with pytest.raises(ConnectionError):
        await view.refresh()
    registry.list_workers = readable
    await view.refresh()  # readable again: nobody is lost for heartbeats nobody could see
    assert addresses(view, "decode") == ["decode:0", "decode:1"]
    clock.now_s += 5.5
    await view.refresh()
    assert addresses(view, "decode") == []  # nobody beat in the 5.5 s the router could see


class HangingStream(FakeStream):
    """Sends ``break_after`` tokens, then neither a message nor an error (a SIGSTOPped worker)."""

    async def __aiter__(self):
        for i in range(self.start, self.start + self.break_after, 2):
            yield DecodeTokens(tuple(self.answer[i : i + 2]))
            await asyncio.sleep(0)
        await asyncio.Event().wait()


async def lose(view, registry, address: str, clients=None) -> None:
    """Moves the fake clock past the loss bound with every worker but ``address`` beating (and,
    with ``clients``, ``address`` not answering health checks: hung)."""
    if clients is not None:
        clients.health_of[address] = Health.UNKNOWN
    view.loss.clock.now_s += 5.5
    for w in registry.workers:
        if w.address != address:
            beat(registry, w.address)
    await view.refresh()


async def generation_with_clock(tokenizer):
    generation, clients, view, registry = await make_generation(tokenizer)
    view.loss = LossWatch(5.0, Clock())
    await view.refresh()
    return generation, clients, view, registry


async def test_a_hung_decode_stream_migrates_once_its_worker_is_lost(tokenizer):
    generation, clients, view, registry = await generation_with_clock(tokenizer)
    decode = clients.decode
    hung = asyncio.Event()

    def hang_on_decode0(address, request_id, request, prefill, timeout_s, output_token_ids=()):
        stream = decode(address, request_id, request, prefill, timeout_s, output_token_ids)
        if address != "decode:0":
            return stream
        hung.set()
        return HangingStream(address, clients.answer, stream.start, 4)

    clients.decode = hang_on_decode0
    task = asyncio.create_task(run(generation))
    await hung.wait()
    for _ in range(10):
        await asyncio.sleep(0)  # its 4 tokens arrive, then it hangs
    assert not task.done()
    await lose(view, registry, "decode:0", clients)
    tokens, finished = await asyncio.wait_for(task, timeout=5)
    assert tokens == clients.answer  # nothing repeated, nothing missing
    assert finished.finish_reason is FinishReason.LENGTH
    assert [(a, resume) for a, _, _, resume in clients.decode_calls] == [
        ("decode:0", ()), ("decode:1", tuple(clients.answer[:5]))]
    assert counter(generation, "tandem:migrations_total") == 1
    assert addresses(view, "decode") == ["decode:1"]


async def test_a_hung_prefill_is_retried_once_its_worker_is_lost(tokenizer):
    generation, clients, view, registry = await generation_with_clock(tokenizer)
    prefill = clients.prefill
    hung = asyncio.Event()

    async def hang_on_prefill0(address, request_id, request, timeout_s):
        if address == "prefill:0":
            clients.prefill_calls.append((address, request_id))
            hung.set()
            await asyncio.Event().wait()
        return await prefill(address, request_id, request, timeout_s)

    clients.prefill = hang_on_prefill0
    task = asyncio.create_task(run(generation))
    await hung.wait()
    await lose(view, registry, "prefill:0", clients)
    tokens, _ = await asyncio.wait_for(task, timeout=5)
    assert tokens == clients.answer
    assert [a for a, _ in clients.prefill_calls] == ["prefill:0", "prefill:1"]
    assert counter(generation, "tandem:prefill_retries_total") == 1
    # Pool state is released by the workers' KV connectors (or the lease deadline), never the router.
    assert not hasattr(clients, "release")


async def test_unless_lost_cancels_a_hung_call_and_names_the_worker():
    lost = asyncio.Event()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def hung():
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()

    task = asyncio.create_task(unless_lost(hung(), lost, "prefill:0"))
    await started.wait()
    lost.set()
    with pytest.raises(WorkerFailedError) as info:
        await task
    assert info.value.address == "prefill:0" and cancelled.is_set()
    assert await unless_lost(asyncio.sleep(0, result=7), asyncio.Event(), "x") == 7


async def test_stream_unless_lost_passes_items_and_errors_through():
    async def items():
        yield 1
        yield 2
        raise WorkerFailedError("broke", "decode:0")

    seen = []
    with pytest.raises(WorkerFailedError, match="broke"):
        async for item in stream_unless_lost(items(), asyncio.Event(), "decode:0"):
            seen.append(item)
    assert seen == [1, 2]


def test_loss_after_must_be_positive():
    with pytest.raises(ValueError, match="loss_after_s must be > 0, got 0"):
        LossWatch(0)


def test_the_loss_bound_follows_the_heartbeat_ttl_a_worker_announces():
    clock = Clock()
    watch = LossWatch(5.0, clock)
    quick = WorkerInfo("d0", "decode", "decode:0", heartbeat_time_s=1.0, heartbeat_ttl_s=3.0)
    slow = WorkerInfo("d1", "decode", "decode:1", heartbeat_time_s=1.0, heartbeat_ttl_s=600.0)
    assert (watch.bound_s(quick), watch.bound_s(slow)) == (5.0, 602.0)
    watch.observe([quick, slow])
    clock.now_s += 30.0
    assert [w.address for w in watch.observe([quick, slow])] == ["decode:0"]
    watch.lose("decode:0")
    assert [w.address for w in watch.known("decode")] == ["decode:1"]


async def test_a_late_heartbeat_of_a_worker_that_answers_serving_is_spared(tokenizer):
    """A worker starved of CPU beats late but still answers: its streams are not abandoned."""
    generation, clients, view, registry = await generation_with_clock(tokenizer)
    event = view.loss.lost_event("decode:0")
    await lose(view, registry, "decode:0")  # health: SERVING (the fakes' default)
    assert not event.is_set() and addresses(view, "decode") == ["decode:0", "decode:1"]
    await lose(view, registry, "decode:0", clients)  # now it does not answer either
    assert event.is_set() and addresses(view, "decode") == ["decode:1"]
