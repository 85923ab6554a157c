"""engine.kv_connector.locator with the pool found through the registry: the first ring is read,
later ones are refreshed in the background, so a worker cut off from Redis keeps the ring it knew
instead of waiting on (or failing with) Redis in every KV load."""

from __future__ import annotations

import asyncio

import pytest

from core.registry import WorkerInfo
from engine.kv_connector.locator import REFRESH_S, PoolLocator

NEVER_S = 20.0  # a ring() still waiting this long waited on Redis


class Registry:
    """Pool entries; ``silent`` makes reads hang (a partition), ``error`` makes them fail."""

    def __init__(self, addresses: list[str]):
        self.addresses = addresses
        self.silent = False
        self.error: Exception | None = None
        self.num_reads = 0

    async def list_workers(self, role: str) -> list[WorkerInfo]:
        assert role == "pool"
        self.num_reads += 1
        if self.silent:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        return [WorkerInfo(f"pool-{i}", "pool", a) for i, a in enumerate(self.addresses)]


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


async def settle() -> None:
    """Lets a background refresh that can finish do so (a few loop turns, no wall time)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_known_ring_is_served_while_the_registry_is_silent_or_failing():
    registry, clock = Registry(["10.0.0.5:50051"]), Clock()
    locator = PoolLocator(registry, clock=clock)
    first = await locator.ring()
    assert first.nodes == {"pool-0": "10.0.0.5:50051"} and registry.num_reads == 1
    registry.silent = True  # cut off from Redis
    clock.now_s += REFRESH_S + 0.5
    assert await asyncio.wait_for(locator.ring(), NEVER_S) is first
    assert await asyncio.wait_for(locator.ring(), NEVER_S) is first
    await settle()
    assert registry.num_reads == 2  # one refresh in the background, hanging; not one per call
    registry.silent = False
    locator._refreshing.cancel()  # the hung read ends (the Redis client's timeout, in a worker)
    await settle()
    registry.error = ConnectionError("Error 111 connecting to redis")
    clock.now_s += REFRESH_S + 0.5
    assert await locator.ring() is first
    await settle()
    registry.error, registry.addresses = None, []  # readable, but the pool node's entry expired
    clock.now_s += REFRESH_S + 0.5
    assert await locator.ring() is first
    await settle()
    assert await locator.ring() is first
    assert registry.num_reads == 4


async def test_a_refresh_that_finds_other_nodes_replaces_the_ring():
    registry, clock = Registry(["10.0.0.5:50051"]), Clock()
    locator = PoolLocator(registry, clock=clock)
    first = await locator.ring()
    clock.now_s += REFRESH_S / 2
    assert await locator.ring() is first and registry.num_reads == 1  # fresh enough: no read
    registry.addresses = ["10.0.0.5:50051", "10.0.0.6:50051"]
    clock.now_s += REFRESH_S
    assert await locator.ring() is first  # served at once; the refresh runs behind it
    await settle()
    assert (await locator.ring()).nodes == {"pool-0": "10.0.0.5:50051", "pool-1": "10.0.0.6:50051"}


async def test_without_a_known_ring_a_registry_error_is_a_lookup_error():
    """The Prefill RPC answers UNAVAILABLE on LookupError; a raw Redis error became UNKNOWN, which
    the router counts as the worker failing."""
    registry = Registry([])
    locator = PoolLocator(registry, clock=Clock())
    with pytest.raises(LookupError, match="no KV pool is registered"):
        await locator.ring()
    registry.error = TimeoutError("Timeout reading from 10.0.0.9:6379")
    with pytest.raises(LookupError, match="cannot read the KV pool nodes from the registry: TimeoutError: Timeout "
                                          "reading from 10.0.0.9:6379"):
        await locator.ring()


async def test_a_fixed_pool_address_never_reads_the_registry():
    registry = Registry(["10.0.0.5:50051"])
    locator = PoolLocator(registry, "127.0.0.1:7000,127.0.0.1:7001", clock=Clock())
    assert (await locator.ring()).nodes == {"127.0.0.1:7000": "127.0.0.1:7000", "127.0.0.1:7001": "127.0.0.1:7001"}
    assert registry.num_reads == 0
