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
