"""KVConnector.release when the pool does not answer: sent again until the pool takes it (a
partition that heals), never past the lease deadline, not for an answer that is no network fault."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from core.kv_cache_spec import KVCacheSpec
from core.pool_ring import HashRing
from engine.kv_connector import KVConnector, PoolLocator

SPEC = KVCacheSpec("m", "r", "float32", 2, 2, 8, 4)


class _Error(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


class _FlakyPool:
    """Stands in for PoolIO: each release fails with ``codes`` in turn, then is taken."""

    def __init__(self, *codes: grpc.StatusCode, lease_ttl_s: float = 60.0):
        self.codes = list(codes)
        self.lease_ttl_s = lease_ttl_s
        self.attempts = 0
        self.taken: list[str] = []

    async def release(self, ring, request_id: str) -> None:
        self.attempts += 1
        if self.codes:
            raise _Error(self.codes.pop(0))
        self.taken.append(request_id)


def _holding(pool: _FlakyPool, delays_s=(0.0, 0.01)) -> KVConnector:
    connector = KVConnector(SPEC, PoolLocator(None, "", "grpc"), io=pool, release_retry_delays_s=delays_s)
    connector._holding["r1"] = HashRing({"pool:1": "pool:1"})  # as after a save or a manifest taken over
    return connector


async def _retries_done(connector: KVConnector) -> None:
    await asyncio.gather(*connector._release_retries)


async def test_a_release_the_pool_did_not_get_is_sent_again_until_taken():
    U = grpc.StatusCode.UNAVAILABLE
    pool = _FlakyPool(U, grpc.StatusCode.DEADLINE_EXCEEDED, U)
    connector = _holding(pool)
    await connector.release("r1")  # fails at once; the retries run in the background
    assert pool.taken == [] and len(connector._release_retries) == 1
    await _retries_done(connector)
    assert pool.taken == ["r1"] and pool.attempts == 4 and connector.num_releases == 1
    await connector.release("r1")  # released once: a second call sends nothing
    assert pool.attempts == 4


async def test_retries_stop_at_the_lease_deadline():
    pool = _FlakyPool(*[grpc.StatusCode.UNAVAILABLE] * 100, lease_ttl_s=0.05)
    connector = _holding(pool, delays_s=(0.02,))
    await connector.release("r1")
    await asyncio.wait_for(_retries_done(connector), timeout=5)
    assert pool.taken == [] and 2 <= pool.attempts <= 3  # the first, then one or two within 0.05 s


@pytest.mark.parametrize("code", [grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT])
async def test_an_answer_that_is_no_network_fault_is_not_retried(code):
    pool = _FlakyPool(code)
    connector = _holding(pool)
    await connector.release("r1")
    assert connector._release_retries == set() and pool.attempts == 1


async def test_close_cancels_the_retries():
    pool = _FlakyPool(*[grpc.StatusCode.UNAVAILABLE] * 100)
    pool.close = lambda: None
    connector = _holding(pool, delays_s=(10.0,))
    await connector.release("r1")
    (task,) = connector._release_retries
    connector.close()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pool.attempts == 1
