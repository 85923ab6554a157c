"""Worker registry in Redis: one key per worker, refreshed by heartbeat, expiring by TTL (docs/design.md §6).

Key ``tandem:workers:{role}:{worker_id}`` holds a JSON :class:`WorkerInfo`; a worker that stops
heartbeating disappears by itself after ``ttl_s``. Its ``load`` is a
:class:`core.worker_load.WorkerLoad` in that module's versioned wire format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.worker_load import LOAD_VERSION, WorkerLoad

log = logging.getLogger(__name__)

KEY_PREFIX = "tandem:workers"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # every service's --redis-url unless told otherwise
ROLES = ("prefill", "decode", "pool")
REDIS_TIMEOUT_S = 5.0  # connect and each command (generous: a loaded machine answers late)


NO_LOAD = WorkerLoad()  # what a worker that publishes no load (a pool node) has


@dataclass
class WorkerInfo:
    """What the router knows of one worker; ``load`` is its latest stats snapshot, parsed once
    when the entry is read (NO_LOAD for a pool node, whose stats are ``pool_stats``).

    ``spec_fingerprint`` and ``block_size`` are the worker's KVCacheSpec's (empty / 0 for a pool
    node or an older worker): with them the router computes a prompt's block hashes
    (core.block_hash) and looks its prefix up in the pool's index.
    """

    worker_id: str
    role: str
    address: str
    load: WorkerLoad = NO_LOAD
    heartbeat_time_s: float = 0.0
    heartbeat_ttl_s: float = 0.0  # its registry key's TTL (0: an older worker that does not say)
    spec_fingerprint: str = ""
    block_size: int = 0
    # A pool node's stats (kv_pool.block_types.PoolStats as numbers: bytes, blocks, hits and
    # misses by tier, leases), published by its heartbeat for the router's cluster view; empty
    # for a worker (its load is ``load``).
    pool_stats: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if not isinstance(self.pool_stats, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in self.pool_stats.values()):
            raise ValueError(f"pool_stats of {self.worker_id!r} must map names to numbers, got {self.pool_stats!r}")

    def to_json(self) -> str:
        """The registry entry: these fields, ``load`` in its wire format (``{}`` for NO_LOAD)
        and ``load_version``."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["load"] = {} if self.load == NO_LOAD else self.load.to_wire()
        data["load_version"] = LOAD_VERSION
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> WorkerInfo:
        """Parses a registry entry; keys this version does not know are ignored (a newer worker),
        missing optional ones take their defaults (an older worker; no ``load_version``: 1).

        Raises:
            ValueError: not JSON, a required key (worker_id, role, address) is missing, or the
                load is of another version or malformed (core.worker_load).
        """
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"bad worker entry {text[:200]!r}: not a JSON object")
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        try:
            values["load"] = WorkerLoad.from_wire(values.get("load") or {}, data.get("load_version", 1))
        except (ValueError, AttributeError) as err:
            raise ValueError(f"bad worker entry of {data.get('worker_id')!r}: {err}") from None
        try:
            return cls(**values)
        except TypeError as err:
            raise ValueError(f"bad worker entry {text[:200]!r}: {err}") from None


def worker_key(role: str, worker_id: str) -> str:
    return f"{KEY_PREFIX}:{role}:{worker_id}"


class WorkerRegistry:
    """Reads and writes worker entries; holds one Redis connection pool."""

    def __init__(self, redis_url: str):
        # Timeouts: a hung Redis (SIGSTOP, a partition) fails a call instead of hanging it, so
        # heartbeats, routers and the index mirror carry on and retry.
        self.redis = aioredis.from_url(redis_url, decode_responses=True, socket_timeout=REDIS_TIMEOUT_S,
                                       socket_connect_timeout=REDIS_TIMEOUT_S)

    async def heartbeat(self, info: WorkerInfo, ttl_s: float) -> None:
        """Writes ``info`` with a fresh time stamp and ``ttl_s``; the key expires after ``ttl_s``.
        Mutates: ``info.heartbeat_time_s``, ``info.heartbeat_ttl_s``."""
        info.heartbeat_time_s, info.heartbeat_ttl_s = time.time(), ttl_s
        await self.redis.set(worker_key(info.role, info.worker_id), info.to_json(), px=int(ttl_s * 1000))

    async def deregister(self, role: str, worker_id: str) -> None:
        await self.redis.delete(worker_key(role, worker_id))

    async def list_workers(self, role: str) -> list[WorkerInfo]:
        """Every live worker of ``role``, sorted by worker_id."""
        keys = [key async for key in self.redis.scan_iter(match=f"{KEY_PREFIX}:{role}:*", count=100)]
        if not keys:
            return []
        values = await self.redis.mget(keys)
        workers = []
        for value in values:
            if value is None:  # expired between SCAN and MGET
                continue
            try:
                workers.append(WorkerInfo.from_json(value))
            except ValueError as err:  # e.g. a worker of another release: not routed to, said why
                log.error("skipping a worker entry: %s", err)
        return sorted(workers, key=lambda w: w.worker_id)

    async def server_id(self) -> str:
        """The Redis server's ``run_id``: a new one each time a server starts (a restarted or
        failed-over Redis may have lost every entry); "" where INFO is refused (some managed
        Redis services disable it). Raises redis connection errors."""
        try:
            info = await self.redis.info("server")
        except aioredis.ResponseError:
            return ""
        return str(info.get("run_id", ""))

    async def close(self) -> None:
        await self.redis.aclose()


class Heartbeat:
    """Background task that re-registers a worker every ``interval_s`` with its live load
    (``load_fn`` None: the entry carries none; a pool node's returns its stats mapping, kept in
    ``WorkerInfo.pool_stats``)."""

    def __init__(
        self,
        registry: WorkerRegistry,
        info: WorkerInfo,
        load_fn: Callable[[], WorkerLoad | Mapping[str, float]] | None,
        interval_s: float = 1.0,
        ttl_s: float = 3.0,
    ):
        if ttl_s <= interval_s:
            raise ValueError(f"heartbeat ttl_s ({ttl_s}) must exceed interval_s ({interval_s})")
        self.registry, self.info, self.load_fn = registry, info, load_fn
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Registers, then beats every ``interval_s`` in the background. Returns once registered:
        while Redis cannot be reached (a pod that starts before the Redis Service answers), the
        first registration is retried every ``interval_s``, each failure logged. A Redis that
        answers with an error (a wrong password, say) raises at once."""
        while True:
            try:
                await self._beat()
                break
            except (RedisConnectionError, RedisTimeoutError) as err:
                log.warning("cannot register %s %s in Redis yet (%s: %s); retrying in %.1f s", self.info.role,
                            self.info.worker_id, type(err).__name__, err, self.interval_s)
                await asyncio.sleep(self.interval_s)
        self._task = asyncio.create_task(self._run())

    async def _beat(self) -> None:
        if self.load_fn is not None:
            load = self.load_fn()  # a worker's WorkerLoad, or a pool node's stats
            if isinstance(load, WorkerLoad):
                self.info.load = load
            else:
                self.info.pool_stats = dict(load)
        await self.registry.heartbeat(self.info, self.ttl_s)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat()
            except Exception as err:  # Redis down: keep trying, the TTL tells the router
                log.warning("heartbeat failed: %s: %s", type(err).__name__, err)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        await self.registry.deregister(self.info.role, self.info.worker_id)
