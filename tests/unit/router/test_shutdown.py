"""router.shutdown.Shutdown from plain coroutines: refusal, counting, abort of a running step."""

from __future__ import annotations

import asyncio

import pytest

from router.errors import ErrorKind, RouterError
from router.shutdown import Shutdown


async def test_guard_passes_results_and_errors_through() -> None:
    shutdown = Shutdown()

    async def value() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("boom")

    assert await shutdown.guard(value()) == 7
    with pytest.raises(ValueError, match="boom"):
        await shutdown.guard(fails())


async def test_abort_ends_a_running_step_after_its_cleanup() -> None:
    shutdown = Shutdown()
    parked, cleaned_up = asyncio.Event(), []

    async def step() -> None:
        parked.set()
        try:
            await asyncio.Event().wait()
        finally:
            cleaned_up.append(True)

    guarded = asyncio.create_task(shutdown.guard(step()))
    await asyncio.wait_for(parked.wait(), 5)
    shutdown.abort()
    with pytest.raises(RouterError) as info:
        await asyncio.wait_for(guarded, 5)
    assert (info.value.kind, info.value.message, info.value.http_status) == (
        ErrorKind.SHUTTING_DOWN, "router shutting down", 503)
    assert cleaned_up == [True]
    with pytest.raises(RouterError, match="router shutting down"):  # later steps: at once
        await shutdown.guard(asyncio.sleep(0))


async def test_a_cancelled_caller_cancels_its_step() -> None:
    shutdown = Shutdown()
    parked, cancelled = asyncio.Event(), asyncio.Event()

    async def step() -> None:
        parked.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    guarded = asyncio.create_task(shutdown.guard(step()))
    await asyncio.wait_for(parked.wait(), 5)
    guarded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await guarded
    assert cancelled.is_set()


async def test_begin_refuses_new_requests_and_wait_idle_counts_running_ones() -> None:
    shutdown = Shutdown()
    shutdown.enter()
    shutdown.enter()
    shutdown.begin()
    with pytest.raises(RouterError) as info:
        shutdown.enter()
    assert info.value.to_openai()["error"]["code"] == "shutting_down"
    assert shutdown.num_running == 2
    assert await shutdown.wait_idle(0.01) is False
    shutdown.leave()
    shutdown.leave()
    assert shutdown.num_running == 0
    assert await shutdown.wait_idle(0.01) is True
