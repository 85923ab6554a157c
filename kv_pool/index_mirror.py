"""Mirrors one pool node's content-addressed index into Redis (docs/design.md §6).

For every block stored or evicted on this node:

- hash ``tandem:kv_index:{spec_fingerprint}``: field = block hash as 16 hex chars, value =
  ``{node_id}:{tier}`` with tier ``dram`` or ``nvme`` (HSET on stored and demoted; on evicted,
  HDEL only if the field still names this node; node ids contain no ``:``);
- stream ``tandem:kv_events``: ``{type: stored|demoted|evicted, fp, hash, node}``, trimmed to about
  ``stream_maxlen`` entries, so a router can rebuild its prefix view after a restart.

The block store stays synchronous and Redis-free: it calls ``report`` (non-blocking) and a
background task writes the queued events in batches, each batch one Lua script call (building a
command per event cost ~45 ms of the pool's event loop per 1024 events, which delayed the RPCs
right behind a large put). The index is a routing hint; the
pool's own ``Lookup`` is the truth, so a Redis outage only delays the mirror (batches are retried).

Redis restarted with its data lost: the node is the truth, so the index is rebuilt
from it. The key ``tandem:kv_index_node:{node_id}`` says the node's index is in this Redis;
:meth:`IndexMirror.watch` checks it every second and, when it is gone, queues one event per block
the node holds (``BlockStore.index_events``) behind the events already queued, then marks it
complete. Replaying queued events over the snapshot is safe: each key's last event is its state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from core.kv_index import (  # noqa: F401  (re-exported: the pool's index layout)
    EVENTS_STREAM, INDEX_KEY_PREFIX, hash_field, index_key, index_value, parse_index_value,
)
from kv_pool.block_types import BlockEvent

log = logging.getLogger(__name__)


# HDEL the field only while it still names this node (ARGV[2], with or without ":tier"): another
# node may have stored it since.
_HDEL_IF_OWNER = """
local value = redis.call('HGET', KEYS[1], ARGV[1])
if value and (value == ARGV[2] or string.sub(value, 1, string.len(ARGV[2]) + 1) == ARGV[2] .. ':') then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

# One batch of events, in order. KEYS[1] = the stream, KEYS[2..] = index hashes.
# ARGV = maxlen, node_id, then per event: index of its hash in KEYS, type, fp, field, value
# (value "" means evicted: HDEL only if the field still names this node, as above).
_APPLY_EVENTS = """
local maxlen, node = ARGV[1], ARGV[2]
local prefix = node .. ':'
for i = 3, #ARGV, 5 do
  local key, kind, fp, field, value = KEYS[tonumber(ARGV[i])], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  if value ~= '' then
    redis.call('HSET', key, field, value)
  else
    local current = redis.call('HGET', key, field)
    if current and (current == node or string.sub(current, 1, string.len(prefix)) == prefix) then
      redis.call('HDEL', key, field)
    end
  end
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'type', kind, 'fp', fp, 'hash', field, 'node', node)
end
return (#ARGV - 2) / 5
"""


NODE_KEY_PREFIX = "tandem:kv_index_node:"
_MARK = object()  # queued after a full snapshot: the index of this node is complete again


class IndexMirror:
    """Queues block events and writes them to Redis; ``redis`` must decode responses to str."""

    def __init__(self, redis: aioredis.Redis, node_id: str, stream_maxlen: int = 100_000, batch_max: int = 512):
        self._redis = redis
        self.node_id = node_id
        self.stream_maxlen = stream_maxlen
        self.batch_max = batch_max
        self._queue: asyncio.Queue = asyncio.Queue()  # BlockEvent, _MARK, or None (stop)
        self._hdel_if_owner = redis.register_script(_HDEL_IF_OWNER)
        self._apply_events = redis.register_script(_APPLY_EVENTS)
        self._task: asyncio.Task | None = None
        self.num_resyncs = 0  # full re-publications after the index was lost

    @property
    def node_key(self) -> str:
        return f"{NODE_KEY_PREFIX}{self.node_id}"

    async def watch(self, snapshot: Callable[[], list[BlockEvent]], interval_s: float = 1.0) -> None:
        """Forever: every ``interval_s``, when this node's key is missing (Redis lost its data),
        sets it to "pending", queues ``snapshot()`` and a mark that turns it "complete" once
        written, only if it still exists: should Redis restart again before then, the key is
        gone again and the next round re-publishes. Redis errors are logged and retried next
        round. Mutates: the queue, ``num_resyncs``, Redis (the node key)."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                if await self._redis.exists(self.node_key):
                    continue
                await self._redis.set(self.node_key, "pending")
            except (RedisError, OSError):
                log.debug("index watch: Redis unreadable", exc_info=True)
                continue
            events = snapshot()
            for event in events:
                self._queue.put_nowait(event)
            self._queue.put_nowait(_MARK)
            self.num_resyncs += 1
            log.warning("the block index of node %s is gone from Redis (restarted?); re-publishing %d blocks",
                        self.node_id, len(events))

    def report(self, event: BlockEvent) -> None:
        """Queues one event; never blocks (the block store's ``on_event``). Mutates: the queue."""
        self._queue.put_nowait(event)

    async def start(self) -> None:
        """Clears this node's stale entries (a starting pool holds no blocks), then starts writing.

        Raises:
            redis.exceptions.RedisError: Redis is unreachable.
        """
        num_cleared = await self.clear_node()
        if num_cleared:
            log.info("cleared %d stale index entries of node %s", num_cleared, self.node_id)
        await self._redis.set(self.node_key, "pending")
        self._queue.put_nowait(_MARK)  # the (empty) index of this node is complete
        self._task = asyncio.create_task(self._run(), name="kv-index-mirror")

    async def stop(self, timeout_s: float = 2.0) -> None:
        """Writes what is queued (up to ``timeout_s``), then removes this node's entries."""
        if self._task is not None:
            self._queue.put_nowait(None)
            try:
                await asyncio.wait_for(self._task, timeout_s)
            except asyncio.TimeoutError:
                log.warning("index mirror did not drain within %.1f s", timeout_s)
        try:
            await self._redis.delete(self.node_key)
            await self.clear_node()
        except (RedisError, OSError):
            log.warning("could not clear index entries of node %s", self.node_id, exc_info=True)

    async def clear_node(self) -> int:
        """Deletes every index field naming this node, with an "evicted" event each.

        Returns how many were deleted. Mutates: Redis (index hashes, event stream).
        """
        num_cleared = 0
        async for key in self._redis.scan_iter(match=f"{INDEX_KEY_PREFIX}*", count=100):
            fields = [
                f async for f, value in self._redis.hscan_iter(key, count=1000)
                if parse_index_value(value)[0] == self.node_id
            ]
            if not fields:
                continue
            fp = key[len(INDEX_KEY_PREFIX) :]
            async with self._redis.pipeline(transaction=False) as pipe:
                for field in fields:
                    await self._hdel_if_owner(keys=[key], args=[field, self.node_id], client=pipe)
                    pipe.xadd(EVENTS_STREAM, self._entry("evicted", fp, field), maxlen=self.stream_maxlen)
                await pipe.execute()
            num_cleared += len(fields)
        return num_cleared

    async def sweep_dead_nodes(self, live_node_ids: set[str]) -> int:
        """Deletes index fields naming a node that is not live (died without cleaning up), with
        an "evicted" event each; any surviving node may run it. Returns how many.

        Mutates: Redis (index hashes, event stream).
        """
        num_swept = 0
        async for key in self._redis.scan_iter(match=f"{INDEX_KEY_PREFIX}*", count=100):
            dead = [
                (f, parse_index_value(value)[0]) async for f, value in self._redis.hscan_iter(key, count=1000)
                if parse_index_value(value)[0] not in live_node_ids
            ]
            if not dead:
                continue
            fp = key[len(INDEX_KEY_PREFIX) :]
            async with self._redis.pipeline(transaction=False) as pipe:
                for field, node_id in dead:
                    await self._hdel_if_owner(keys=[key], args=[field, node_id], client=pipe)
                    entry = {"type": "evicted", "fp": fp, "hash": field, "node": node_id}
                    pipe.xadd(EVENTS_STREAM, entry, maxlen=self.stream_maxlen)
                await pipe.execute()
            num_swept += len(dead)
        return num_swept

    async def _run(self) -> None:
        backoff_s = 0.1
        while True:
            batch = [await self._queue.get()]
            while len(batch) < self.batch_max and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            stopping = None in batch
            events = [e for e in batch if isinstance(e, BlockEvent)]
            marked = _MARK in batch
            while events or marked:
                try:
                    if events:
                        await self._write(events)
                        events = []
                    if marked:
                        await self._redis.set(self.node_key, "complete", xx=True)
                        marked = False
                    break
                except (RedisError, OSError):
                    log.warning("index mirror write failed; retrying in %.1f s", backoff_s, exc_info=True)
                    await asyncio.sleep(backoff_s)
                    backoff_s = min(backoff_s * 2, 5.0)
            backoff_s = 0.1
            if stopping:
                return

    async def _write(self, events: list[BlockEvent]) -> None:
        """One script call (one round trip) for ``events``, in order. Mutates: Redis."""
        keys = [EVENTS_STREAM]
        key_index: dict[str, int] = {}
        args: list[str | int] = [self.stream_maxlen, self.node_id]
        for event in events:
            key = index_key(event.key.spec_fingerprint)
            if key not in key_index:
                keys.append(key)
                key_index[key] = len(keys)  # Lua's KEYS is 1-based
            value = index_value(self.node_id, event.tier) if event.tier else ""
            args += (key_index[key], event.kind, event.key.spec_fingerprint, hash_field(event.key.block_hash), value)
        await self._apply_events(keys=keys, args=args)

    def _entry(self, kind: str, fp: str, field: str) -> dict[str, str]:
        return {"type": kind, "fp": fp, "hash": field, "node": self.node_id}
