"""Several routers share one Redis and must not fight over it: a router writes nothing
there. Proven with a Redis ACL user that may only read: the router's worker view and its pool
prefix index work through it, and a write through it is refused, so any write a router made would
fail here."""

from __future__ import annotations

import uuid

import pytest
import redis
import redis.asyncio as aioredis

from core.kv_index import hash_field, index_key
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry
from router.placement.prefix_index import PoolPrefixIndex
from router.workers.view import WorkerView

# Reads only: the keyspace (SCAN/MGET/HMGET, ...), INFO (the view's server_id) and PING (redis-py's
# CLIENT SETINFO on connecting is refused and ignored).
READ_ONLY_RULES = ["on", ">router-secret", "~*", "resetchannels", "-@all", "+@read", "+info", "+ping"]


@pytest.fixture
def read_only_url(redis_url: str):
    user = f"router-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", user, "reset", *READ_ONLY_RULES)
    try:
        yield redis_url.replace("redis://", f"redis://{user}:router-secret@")
    finally:
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


async def test_the_router_reads_the_registry_and_the_pool_index_without_writing(redis_url, read_only_url):
    writer = WorkerRegistry(redis_url)  # the workers' and pool nodes' side
    worker_id = f"d-{uuid.uuid4().hex[:8]}"
    beat = Heartbeat(writer, WorkerInfo(worker_id, "decode", "127.0.0.1:1"), None, interval_s=0.5, ttl_s=3.0)
    await beat.start()
    fingerprint = f"spec-{uuid.uuid4().hex[:8]}"
    await writer.redis.hset(index_key(fingerprint), mapping={hash_field(h): "pool-0:dram" for h in (11, 12)})
    reader = WorkerRegistry(read_only_url)  # the router's side
    try:
        with pytest.raises(aioredis.ResponseError, match="no permissions to run the 'set' command"):
            await reader.redis.set("tandem:router-wrote", "1")  # the ACL bites
        view = WorkerView(reader)
        await view.refresh()
        assert worker_id in [w.worker_id for w in view.workers("decode")]
        assert len(await reader.server_id()) == 40
        assert await PoolPrefixIndex(reader.redis).num_cached_blocks(fingerprint, [11, 12, 13]) == 2
    finally:
        await reader.close()
        await beat.stop()
        await writer.redis.delete(index_key(fingerprint))
        await writer.close()
