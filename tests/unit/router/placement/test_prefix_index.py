"""The router's prefix view: the pool's index read from a real Redis, the per-worker LRU."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from core.block_hash import hash_block_chain
from core.kv_index import hash_field, index_key, index_value, parse_index_value
from router.placement.prefix_index import LocalPrefixCache, PoolPrefixIndex, leading_present, prompt_block_hashes


def test_index_layout_as_documented() -> None:
    assert index_key("abc") == "tandem:kv_index:abc"
    assert hash_field(0x1234) == "0000000000001234"
    assert parse_index_value(index_value("node-a", "nvme")) == ("node-a", "nvme")
    assert parse_index_value("node-a") == ("node-a", "")


def test_prompt_hashes_are_the_workers_chain() -> None:
    prompt = list(range(100, 150))
    assert prompt_block_hashes(prompt, 16) == hash_block_chain(prompt, 16)
    assert len(prompt_block_hashes(prompt, 16)) == 3  # the 2-token tail has no hash


def test_leading_present_stops_at_the_first_gap() -> None:
    assert leading_present(["a", "b", None, "d"]) == 2
    assert leading_present([None, "b"]) == 0
    assert leading_present(["a"]) == 1


def test_pool_index_longest_present_prefix(redis_url: str) -> None:
    fingerprint = f"fp-{uuid.uuid4().hex[:8]}"
    hashes = prompt_block_hashes(list(range(64)), 16)  # 4 blocks

    async def scenario() -> list[int]:
        redis = aioredis.from_url(redis_url, decode_responses=True)
        try:
            index = PoolPrefixIndex(redis)
            found = [await index.num_cached_blocks(fingerprint, hashes)]
            await redis.hset(index_key(fingerprint), mapping={
                hash_field(hashes[0]): index_value("node-a", "dram"),
                hash_field(hashes[1]): index_value("node-b", "nvme"),
                hash_field(hashes[3]): index_value("node-a", "dram"),  # block 2 missing: 3 is unusable
            })
            found.append(await index.num_cached_blocks(fingerprint, hashes))
            found.append(await index.num_cached_blocks("other-spec", hashes))
            found.append(await index.num_cached_blocks(fingerprint, []))
            return found
        finally:
            await redis.aclose()

    assert asyncio.run(scenario()) == [0, 2, 0, 0]


def test_local_cache_lru_per_worker() -> None:
    cache = LocalPrefixCache(capacity_blocks=4)
    a = prompt_block_hashes(list(range(48)), 16)  # 3 blocks
    b = prompt_block_hashes(list(range(1000, 1048)), 16)
    cache.record("w1", a)
    assert (cache.num_cached_blocks("w1", a), cache.num_cached_blocks("w2", a)) == (3, 0)
    cache.record("w1", b)  # 6 > 4: a[0] and a[1] (least recently used) go
    assert (cache.num_cached_blocks("w1", a), cache.num_cached_blocks("w1", b)) == (0, 3)
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1, got 0"):
        LocalPrefixCache(0)


class _SilentRedis:
    """HMGET behind a silent partition (never answers) until ``heal``; counts the reads."""

    def __init__(self) -> None:
        self.healed = asyncio.Event()
        self.num_reads = 0

    async def hmget(self, key: str, fields: list[str]) -> list[str | None]:
        self.num_reads += 1
        await self.healed.wait()
        return ["node-a:dram", None][: len(fields)]


async def test_a_silent_index_costs_one_short_wait_then_is_skipped_until_the_retry_time() -> None:
    """A router cut off from Redis: before, every request waited for the Redis client's 5 s
    timeout in its placement. Now the first read gives up after ``timeout_s`` and the next ones
    within ``retry_after_s`` do not ask Redis at all."""
    now_s = [100.0]
    redis = _SilentRedis()
    index = PoolPrefixIndex(redis, timeout_s=0.05, retry_after_s=2.0, clock=lambda: now_s[0])
    never_s = 20.0  # a read still waiting this long was not bounded
    assert await asyncio.wait_for(index.num_cached_blocks("fp", [1, 2]), never_s) == 0
    assert redis.num_reads == 1
    now_s[0] += 1.5
    assert await asyncio.wait_for(index.num_cached_blocks("fp", [1, 2]), never_s) == 0
    assert redis.num_reads == 1  # inside the pause: not asked
    redis.healed.set()
    now_s[0] += 1.0
    assert await index.num_cached_blocks("fp", [1, 2]) == 1
    assert await index.num_cached_blocks("fp", [1, 2]) == 1
    assert redis.num_reads == 3


async def test_a_refused_index_read_is_a_zero_hint_not_an_error() -> None:
    index = PoolPrefixIndex(aioredis.from_url("redis://127.0.0.1:1/0", decode_responses=True,
                                              socket_connect_timeout=5))
    assert await index.num_cached_blocks("fp", [1, 2, 3]) == 0
    await index.redis.aclose()
