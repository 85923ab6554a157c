"""Redis restarted with its data lost: a real pool process re-registers and rebuilds its
block index in the new Redis from what it holds (the pool is the truth), blocks put while Redis
was gone included; a worker heartbeat re-registers by itself.

Each test runs its own redis-server, killed with -9 and started again on the same port (empty:
it never persists), the way ``tandem up`` restarts it.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import uuid

import pytest
import redis
from grpc_health.v1 import health_pb2

from core.block_key import BlockKey
from core.pool_client import PoolClient
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry, worker_key
from kv_pool.index_mirror import hash_field, index_key
from tests.conftest import find_free_port, poll_until
from tests.integration.test_kv_pool_server import KIB, block, health_status, stored_prefix


class RedisServer:
    """A private redis-server on one port, killable and restartable there."""

    def __init__(self) -> None:
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.port = find_free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)

        def ready() -> bool:
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                return False

        poll_until(ready, timeout_s=10, message="redis-server ready")
        client.close()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=2)


@pytest.fixture
def redis_server():
    server = RedisServer()
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()


def test_a_pool_rebuilds_its_index_in_a_restarted_redis(redis_server, tmp_path):
    node_id, port, fp = f"pool-{uuid.uuid4().hex[:8]}", find_free_port(), f"fp-{uuid.uuid4().hex[:8]}"
    log_path = tmp_path / "pool.log"
    with open(log_path, "wb") as log:
        pool = subprocess.Popen([sys.executable, "-m", "kv_pool", "--port", str(port), "--redis-url", redis_server.url,
                                 "--capacity-bytes", str(1024 * KIB), "--node-id", node_id],
                                stdout=log, stderr=subprocess.STDOUT)
    address = f"127.0.0.1:{port}"
    try:
        poll_until(lambda: health_status(address) == health_pb2.HealthCheckResponse.SERVING, timeout_s=30,
                   message="pool SERVING")
        rdb = redis_server.client()
        with PoolClient(address, timeout_s=30) as client:
            client.put_blocks((BlockKey.content(fp, h), block(h, 4 * KIB)) for h in (1, 2, 3))
            expected = {hash_field(h): f"{node_id}:dram" for h in (1, 2, 3)}
            poll_until(lambda: rdb.hgetall(index_key(fp)) == expected, message="index of blocks 1-3")

            redis_server.kill()
            client.put_blocks([(BlockKey.content(fp, 4), block(4, 4 * KIB))])  # the pool serves on
            assert stored_prefix(client, fp, [1, 2, 3, 4]) == 4
            redis_server.start()  # empty

            rdb = redis_server.client()
            expected[hash_field(4)] = f"{node_id}:dram"
            poll_until(lambda: rdb.hgetall(index_key(fp)) == expected, timeout_s=20,
                       message="index rebuilt from the pool, block 4 included")
            poll_until(lambda: rdb.exists(worker_key("pool", node_id)), timeout_s=10, message="pool re-registered")
            # The mirror marks the node complete in the step after the batch that wrote the
            # snapshot (kv_pool.index_mirror): the index can be visible a moment before the mark
            # (a fresh-clone CI run read "pending" here).
            poll_until(lambda: rdb.get(f"tandem:kv_index_node:{node_id}") == "complete", timeout_s=10,
                       message="the node's index marked complete")
            assert "re-publishing 4 blocks" in log_path.read_text()
    finally:
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=20) == 0, log_path.read_text()


async def test_a_heartbeat_re_registers_in_a_restarted_redis(redis_server):
    registry = WorkerRegistry(redis_server.url)
    info = WorkerInfo("d-restart", "decode", "127.0.0.1:1")
    heartbeat = Heartbeat(registry, info, None, interval_s=0.2, ttl_s=1.0)
    await heartbeat.start()
    rdb = redis_server.client()
    try:
        assert rdb.exists(worker_key("decode", "d-restart"))
        redis_server.kill()
        redis_server.start()
        rdb = redis_server.client()
        assert not rdb.exists(worker_key("decode", "d-restart"))  # the data is gone ...
        deadline = asyncio.get_running_loop().time() + 10
        while not rdb.exists(worker_key("decode", "d-restart")):  # ... until the next beat
            assert asyncio.get_running_loop().time() < deadline, "heartbeat did not re-register"
            await asyncio.sleep(0.05)  # polling Redis, not synchronising
    finally:
        await heartbeat.stop()
        await registry.close()


async def test_a_worker_started_before_redis_registers_once_redis_answers(redis_server):
    """A pod may start before the Redis Service answers: the first registration is retried
    (start() returns once it is in), instead of failing the worker's start-up."""
    redis_server.kill()
    registry = WorkerRegistry(redis_server.url)
    info = WorkerInfo("d-early", "decode", "127.0.0.1:1")
    heartbeat = Heartbeat(registry, info, None, interval_s=0.2, ttl_s=1.0)
    starting = asyncio.create_task(heartbeat.start())
    try:
        done, _ = await asyncio.wait({starting}, timeout=0.6)  # three refused attempts
        assert not done
        redis_server.start()
        await asyncio.wait_for(starting, timeout=10)
        assert redis_server.client().exists(worker_key("decode", "d-early"))
    finally:
        if not starting.done():
            starting.cancel()
        elif starting.exception() is None:
            await heartbeat.stop()
        await registry.close()


async def test_a_restarted_redis_has_another_server_id(redis_server):
    """What the router's view reads to tell a Redis restart between two reads (router.workers.view)."""
    registry = WorkerRegistry(redis_server.url)
    try:
        before = await registry.server_id()
        assert len(before) == 40 and before == await registry.server_id()  # INFO's run_id: 40 hex digits
        redis_server.kill()
        redis_server.start()
        after = await poll_server_id(registry)
        assert len(after) == 40 and after != before
    finally:
        await registry.close()


async def poll_server_id(registry: WorkerRegistry) -> str:
    """The server id once the restarted Redis answers (the pool's old connection fails first)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            return await registry.server_id()
        except redis.ConnectionError:
            assert asyncio.get_running_loop().time() < deadline, "restarted redis does not answer"
            await asyncio.sleep(0.05)  # polling Redis, not synchronising
