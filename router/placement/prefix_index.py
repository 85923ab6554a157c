"""The router's prefix view: what the KV pool holds (read from Redis per request) and what each
worker's own prefix cache probably holds (an approximate LRU of the blocks this router sent it).

Pool view: every pool node mirrors its content-addressed index into the Redis hash
``tandem:kv_index:{spec_fingerprint}`` (field: the block hash as 16 hex chars, value
``{node_id}:{tier}``; kv_pool/index_mirror.py writes it). The router hashes the prompt's full
blocks exactly as the workers do (``core.block_hash.hash_block_chain``, no extra keys: see
``engine.kv_connector.pool_io.PoolIO.prompt_keys``) and reads them with one HMGET: the longest run present from
the first block is the pool-cached prefix (Mooncake §5, "cache-aware" prefill scheduling). The
index is read per request, so a restarted router has nothing to rebuild. It is a hint, never
worth a request's wait: a read gets ``READ_TIMEOUT_S``, and after one that failed (Redis down, or
silent behind a partition) the index is not asked again for ``RETRY_AFTER_S``: requests are
placed without it meanwhile. Before, each request of a router cut off from Redis waited out the
Redis client's 5 s timeout before it was placed.

Worker view (:class:`LocalPrefixCache`): the SGLang router's approximate radix tree, flattened to
hash chains. A block hash names its whole prefix, so a per-worker LRU set of hashes answers
"how many leading blocks of this prompt did I send there recently" with one lookup per block.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import redis.asyncio as aioredis

from core.block_hash import hash_block_chain
from core.kv_index import hash_field, index_key

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 1.0  # one HMGET; a Redis that answers at all answers in milliseconds
RETRY_AFTER_S = 2.0  # after a failed read, requests are placed without the index this long


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int) -> list[int]:
    """The prompt's full-block hash chain as the workers compute it (``len // block_size`` hashes).

    Raises:
        ValueError: ``block_size`` < 1.
    """
    return hash_block_chain(list(prompt_token_ids), block_size)


def leading_present(values: Sequence[object | None]) -> int:
    """How many leading entries are present (not None): the cached prefix, in blocks."""
    for i, value in enumerate(values):
        if value is None:
            return i
    return len(values)


class PoolPrefixIndex:
    """Reads the pool's block index in Redis (``redis`` must decode responses to str); see the
    module docstring for the timeout and the pause after a failed read. ``clock``: monotonic
    seconds. Not thread-safe (the router's event loop is its only user)."""

    def __init__(self, redis: aioredis.Redis, timeout_s: float = READ_TIMEOUT_S, retry_after_s: float = RETRY_AFTER_S,
                 clock: Callable[[], float] = time.monotonic):
        self.redis = redis
        self.timeout_s, self.retry_after_s, self.clock = timeout_s, retry_after_s, clock
        self._retry_at_s = float("-inf")  # clock() before which the index is not read

    async def num_cached_blocks(self, spec_fingerprint: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` the pool holds (any node, any tier); 0 when the index
        cannot be read within ``timeout_s`` or a read failed less than ``retry_after_s`` ago
        (logged once per outage). Raises nothing from Redis. Mutates: the retry time."""
        if not block_hashes or not spec_fingerprint or self.clock() < self._retry_at_s:
            return 0
        fields = [hash_field(h) for h in block_hashes]
        try:
            values = await asyncio.wait_for(self.redis.hmget(index_key(spec_fingerprint), fields), self.timeout_s)
        except (asyncio.TimeoutError, aioredis.RedisError, OSError) as err:
            if self._retry_at_s == float("-inf"):
                log.warning("cannot read the pool's prefix index (%s: %s); placing requests without it, "
                            "retrying every %g s", type(err).__name__, err, self.retry_after_s)
            self._retry_at_s = self.clock() + self.retry_after_s
            return 0
        if self._retry_at_s != float("-inf"):
            log.info("the pool's prefix index is readable again")
            self._retry_at_s = float("-inf")
        return leading_present(values)


class LocalPrefixCache:
    """Per worker address, the block hashes this router sent there, least recently used first.

    Approximate by design: the worker may have evicted a block (or, after a router restart, hold
    blocks this router never sent). ``capacity_blocks`` bounds each worker's set; the oldest
    hashes go first. Not thread-safe (the router's event loop is its only user).
    """

    def __init__(self, capacity_blocks: int = 8192):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def num_cached_blocks(self, address: str, block_hashes: Sequence[int]) -> int:
        """Leading blocks of ``block_hashes`` recently sent to ``address``. Mutates nothing."""
        lru = self._lru.get(address)
        if not lru:
            return 0
        return leading_present([True if h in lru else None for h in block_hashes])

    def record(self, address: str, block_hashes: Sequence[int]) -> None:
        """Marks ``block_hashes`` as present at ``address`` and most recently used. Mutates: the
        worker's LRU (evicts the oldest beyond capacity)."""
        lru = self._lru.setdefault(address, OrderedDict())
        for h in block_hashes:
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.capacity_blocks:
            lru.popitem(last=False)
