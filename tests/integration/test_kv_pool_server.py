"""A real ``python -m kv_pool`` process against a real redis-server, driven through PoolClient."""

from __future__ import annotations

import itertools

import asyncio
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.block_key import BlockKey
from core.grpc_service import aio_channel, insecure_channel
from core.pool_client import MAX_CHUNK_BYTES, PoolClient
from core.proto_convert import block_key_to_proto
from core.registry import WorkerInfo, worker_key
from kv_pool.index_mirror import EVENTS_STREAM, hash_field, index_key
from tandem.v1 import common_pb2, kv_pool_pb2, kv_pool_pb2_grpc

KIB = 1024
MIB = 1024 * KIB
SMOLLM_BLOCK_BYTES = 720 * KIB  # SmolLM2-135M, fp32, block_size 16
POOL_CAPACITY_BYTES = 256 * MIB  # the module's shared pool


@dataclass
class PoolProcess:
    proc: subprocess.Popen
    address: str
    node_id: str
    log_path: Path

    def logs(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def health_status(address: str) -> int | None:
    with insecure_channel(address) as channel:
        try:
            request = health_pb2.HealthCheckRequest(service="tandem.v1.KVPool")
            return health_pb2_grpc.HealthStub(channel).Check(request, timeout=0.5).status
        except grpc.RpcError:
            return None



_probes = itertools.count()

def stored_prefix(client: PoolClient, spec_fingerprint: str, block_hashes) -> int:
    """How many leading ``block_hashes`` the pool serves, probed with a LocateBlocks lease that is
    released at once (touches the blocks' LRU position, as any read would)."""
    probe = f"probe-{next(_probes)}"
    try:
        return len(client.locate_blocks([BlockKey.content(spec_fingerprint, h) for h in block_hashes], probe, 30))
    finally:
        client.release_request(probe)

@pytest.fixture(scope="module")
def start_pool(redis_url, free_port_factory, wait_until, tmp_path_factory):
    """``start_pool(capacity_bytes, *flags)`` -> a SERVING pool process, stopped at module end."""
    started: list[PoolProcess] = []

    def start(capacity_bytes: int, *flags: str, node_id: str = "") -> PoolProcess:
        port, node_id = free_port_factory(), node_id or f"pool-{uuid.uuid4().hex[:8]}"
        log_path = tmp_path_factory.mktemp("pool") / f"{node_id}.log"
        cmd = [sys.executable, "-m", "kv_pool", "--port", str(port), "--redis-url", redis_url,
               "--capacity-bytes", str(capacity_bytes), "--node-id", node_id, *flags]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        pool = PoolProcess(proc, f"127.0.0.1:{port}", node_id, log_path)
        started.append(pool)

        def serving() -> bool:
            assert proc.poll() is None, f"pool exited with {proc.returncode}:\n{pool.logs()}"
            return health_status(pool.address) == health_pb2.HealthCheckResponse.SERVING

        wait_until(serving, timeout_s=30, message="pool SERVING")
        return pool

    yield start
    for pool in started:
        pool.stop()


@pytest.fixture(scope="module")
def pool(start_pool) -> PoolProcess:
    return start_pool(POOL_CAPACITY_BYTES)


@pytest.fixture
def client(pool):
    with PoolClient(pool.address, timeout_s=30) as client:
        yield client
        stats = client.stats()  # every scenario leaves the pool idle
        assert [stats[k] for k in ("num_writing_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases")] == [
            0, 0, 0, 0], stats


@pytest.fixture
def rdb(redis_url):
    with redis.Redis.from_url(redis_url, decode_responses=True) as rdb:
        yield rdb


@pytest.fixture
def fp() -> str:
    return uuid.uuid4().hex[:16]


def block(seed: int, num_bytes: int) -> bytes:
    """Random bytes (no repeating pattern, so a misplaced chunk cannot go unnoticed)."""
    return seed.to_bytes(8, "little") + os.urandom(num_bytes - 8)


def assert_code(excinfo: pytest.ExceptionInfo, code: grpc.StatusCode, case: str = "") -> None:
    assert excinfo.value.code() == code, (case, excinfo.value.details())


def test_health_is_serving_and_pool_is_registered(pool, rdb):
    assert health_status(pool.address) == health_pb2.HealthCheckResponse.SERVING
    entry = WorkerInfo.from_json(rdb.get(worker_key("pool", pool.node_id)))
    assert entry.address == pool.address
    # Its stats ride on the heartbeat, for the router's cluster view (router.cluster_metrics).
    assert entry.pool_stats["capacity_bytes"] == POOL_CAPACITY_BYTES
    assert set(entry.pool_stats) >= {"used_bytes", "num_dram_hits", "num_dram_misses", "num_leases"}


def test_put_get_round_trip_single_and_multi_chunk(client, fp):
    blocks = {BlockKey.content(fp, h): block(h, SMOLLM_BLOCK_BYTES) for h in (1, 2, 3)}
    blocks[BlockKey.content(fp, 4)] = block(4, 9 * MIB)  # 3 chunks of <= 4 MiB
    blocks[BlockKey.scoped(fp, "req-rt", 0)] = block(5, 100 * KIB + 3)
    stored_before = client.stats()["num_stored_blocks"]

    assert client.put_blocks(blocks.items()) == (5, 0)
    keys = list(reversed(blocks))
    assert client.get_blocks(keys) == [blocks[k] for k in keys]
    assert client.put_blocks(blocks.items()) == (0, 5)  # no second copy
    stats = client.stats()
    assert stats["num_stored_blocks"] - stored_before == 4 and stats["num_scoped_blocks"] == 1
    client.release_request("req-rt")


async def test_cancelled_put_leaves_nothing_visible(pool, client, fp, wait_until):
    key = BlockKey.content(fp, 1)
    release = asyncio.Event()

    async def first_chunk_then_hang():
        yield kv_pool_pb2.PutBlocksRequest(key=block_key_to_proto(key), block_bytes=9 * MIB, data=bytes(MAX_CHUNK_BYTES))
        await release.wait()

    async with aio_channel(pool.address) as channel:
        call = kv_pool_pb2_grpc.KVPoolStub(channel).PutBlocks(first_chunk_then_hang())
        await asyncio.to_thread(wait_until, lambda: client.stats()["num_writing_blocks"] == 1, message="reserved")
        assert stored_prefix(client, fp, [1]) == 0  # reserved but invisible
        call.cancel()
        await asyncio.to_thread(wait_until, lambda: client.stats()["num_writing_blocks"] == 0, message="aborted")
    assert stored_prefix(client, fp, [1]) == 0
    with pytest.raises(grpc.RpcError) as excinfo:
        client.get_blocks([key])
    assert_code(excinfo, grpc.StatusCode.NOT_FOUND)


@pytest.fixture
def stub(pool):
    """A raw stub, for streams the client would never send."""
    with insecure_channel(pool.address) as channel:
        yield kv_pool_pb2_grpc.KVPoolStub(channel)


def test_stream_ending_mid_block_is_invalid_and_rolled_back(stub, client, fp):
    key_msg = block_key_to_proto(BlockKey.content(fp, 1))
    with pytest.raises(grpc.RpcError) as excinfo:
        stub.PutBlocks(iter([kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=10, data=b"12345")]))
    assert_code(excinfo, grpc.StatusCode.INVALID_ARGUMENT)
    assert "stream ended inside" in excinfo.value.details()
    assert stored_prefix(client, fp, [1]) == 0


def test_locate_leases_the_stored_prefix_and_release_drops_it(client, fp):
    client.put_blocks((BlockKey.content(fp, h), block(h, 64 * KIB)) for h in (1, 2, 3, 5))
    assert stored_prefix(client, fp, [1, 2, 3, 4, 5]) == 3
    assert stored_prefix(client, fp, [2, 3]) == 2
    assert stored_prefix(client, fp, [4, 5]) == 0
    assert stored_prefix(client, "another-spec", [1]) == 0
    assert len(client.locate_blocks([BlockKey.content(fp, h) for h in (1, 2, 4)], "req-lease", 30)) == 2
    stats = client.stats()
    assert (stats["num_leased_blocks"], stats["num_leases"]) == (2, 1)
    client.release_request("req-lease")
    client.release_request("req-lease")  # idempotent


def test_scoped_block_is_freed_by_release_request(client, fp):
    key, data = BlockKey.scoped(fp, "req-tail", 3), block(9, 48 * KIB)
    assert client.put_blocks([(key, data)], lease_request_id="req-tail") == (1, 0)
    assert client.stats()["num_scoped_blocks"] == 1
    assert client.get_blocks([key]) == [data]
    client.release_request("req-tail")
    assert client.stats()["num_scoped_blocks"] == 0
    with pytest.raises(grpc.RpcError) as excinfo:
        client.get_blocks([key])
    assert_code(excinfo, grpc.StatusCode.NOT_FOUND)


def test_malformed_input_and_unknown_keys_get_exact_codes(stub, client, fp):
    key_msg = block_key_to_proto(BlockKey.content(fp, 1))
    no_id = common_pb2.BlockKey(spec_fingerprint=fp)
    no_fp = block_key_to_proto(BlockKey.content("", 1))
    bad_streams = {
        "key without id": [kv_pool_pb2.PutBlocksRequest(key=no_id, block_bytes=4, data=b"abcd")],
        "empty fingerprint": [kv_pool_pb2.PutBlocksRequest(key=no_fp, block_bytes=4, data=b"abcd")],
        "first chunk not at 0": [kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=4, offset_bytes=2, data=b"cd")],
        "offset gap": [kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=4, data=b"ab"),
                       kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=4, offset_bytes=3, data=b"d")],
        "size mismatch": [kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=4, data=b"ab"),
                          kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=5, offset_bytes=2, data=b"cd")],
        "past the end": [kv_pool_pb2.PutBlocksRequest(key=key_msg, block_bytes=4, data=b"abcde")],
    }
    for case, stream in bad_streams.items():
        with pytest.raises(grpc.RpcError) as excinfo:
            stub.PutBlocks(iter(stream))
        assert_code(excinfo, grpc.StatusCode.INVALID_ARGUMENT, case)
    with pytest.raises(grpc.RpcError) as excinfo:
        client.locate_blocks([BlockKey.content(fp, 1)], "", 30)  # no request_id
    assert_code(excinfo, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as excinfo:
        list(stub.GetBlocks(kv_pool_pb2.GetBlocksRequest(keys=[no_id])))
    assert_code(excinfo, grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(grpc.RpcError) as excinfo:
        client.get_blocks([BlockKey.content(fp, 0xABC)])
    assert_code(excinfo, grpc.StatusCode.NOT_FOUND)
    assert "block_hash=2748" in excinfo.value.details()
    assert stored_prefix(client, fp, [1]) == 0


def test_redis_index_follows_commits_and_evictions(start_pool, rdb, fp, free_port, wait_until):
    node_id = f"pool-{uuid.uuid4().hex[:8]}"
    # A live other node (its entries survive the dead-node sweep of every pool).
    rdb.set(worker_key("pool", "other-node"), '{"worker_id": "other-node", "role": "pool", "address": "x:1"}', ex=120)
    rdb.hset(index_key(fp), mapping={"00000000000000ff": "other-node", "00000000000000fe": node_id})
    node_blocks = 64 * KIB
    # Evicting only on demand (watermarks at 1), so each put below evicts exactly what it needs.
    pool = start_pool(4 * node_blocks, "--metrics-port", str(free_port), "--evict-high-watermark", "1",
                      "--evict-low-watermark", "1", node_id=node_id)
    assert rdb.hgetall(index_key(fp)) == {"00000000000000ff": "other-node"}  # own stale entry cleared
    with PoolClient(pool.address, timeout_s=30) as client:
        client.put_blocks((BlockKey.content(fp, h), block(h, node_blocks)) for h in (1, 2, 3, 4))
        client.get_blocks([BlockKey.content(fp, 1)])  # 1 becomes most recently used
        client.put_blocks((BlockKey.content(fp, h), block(h, node_blocks)) for h in (5, 6))  # evicts 2, 3
        assert stored_prefix(client, fp, [1, 2, 3, 4, 5, 6]) == 1 and stored_prefix(client, fp, [4, 5, 6]) == 3
        expected = {hash_field(h): f"{pool.node_id}:dram" for h in (1, 4, 5, 6)} | {"00000000000000ff": "other-node"}
        wait_until(lambda: rdb.hgetall(index_key(fp)) == expected, message="index == committed minus evicted")
        events = [(e["type"], int(e["hash"], 16)) for _, e in rdb.xrange(EVENTS_STREAM) if e["fp"] == fp]
        assert events == [("evicted", 0xFE)] + [("stored", h) for h in (1, 2, 3, 4)] + [
            ("evicted", 2), ("stored", 5), ("evicted", 3), ("stored", 6)]

        assert len(client.locate_blocks([BlockKey.content(fp, 1)], "req-pin", 30)) == 1
        client.put_blocks([(BlockKey.scoped(fp, "req-pin", 0), block(0, 3 * node_blocks))])  # evicts 4, 5, 6
        with pytest.raises(grpc.RpcError) as excinfo:  # 1 is leased, the rest is scoped
            client.put_blocks([(BlockKey.content(fp, 7), block(7, node_blocks))])
        assert_code(excinfo, grpc.StatusCode.RESOURCE_EXHAUSTED)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{free_port}/metrics", timeout=10).read().decode()
        assert 'tandem:pool_blocks{state="scoped"} 1.0' in metrics
        assert "tandem:pool_evictions_total 5.0" in metrics
        client.release_request("req-pin")
        assert client.stats()["num_scoped_blocks"] == 0
        wait_until(lambda: set(rdb.hgetall(index_key(fp))) == {hash_field(1), "00000000000000ff"},
                   message="index lost 4, 5, 6")
    rdb.delete(worker_key("pool", "other-node"))


def test_index_entries_of_dead_nodes_are_swept(start_pool, rdb, fp, wait_until):
    start_pool(MIB)  # any live pool node sweeps (every 2 x heartbeat ttl = 6 s)
    rdb.hset(index_key(fp), mapping={"00000000000000aa": "dead-node:dram", "00000000000000ab": "dead-node:nvme"})
    wait_until(lambda: not rdb.exists(index_key(fp)), timeout_s=20, message="a survivor swept the dead node's entries")
    events = [(e["type"], e["node"]) for _, e in rdb.xrange(EVENTS_STREAM) if e["fp"] == fp]
    assert events == [("evicted", "dead-node")] * 2


def test_sigterm_exits_zero_and_deregisters(start_pool, rdb, fp, wait_until):
    pool = start_pool(MIB)
    with PoolClient(pool.address, timeout_s=30) as client:
        client.put_blocks([(BlockKey.content(fp, 1), block(1, 4 * KIB))])
    wait_until(lambda: rdb.hget(index_key(fp), hash_field(1)) == f"{pool.node_id}:dram", message="block indexed")
    assert rdb.exists(worker_key("pool", pool.node_id))
    assert pool.stop() == 0, pool.logs()
    assert not rdb.exists(worker_key("pool", pool.node_id))
    assert rdb.hget(index_key(fp), hash_field(1)) is None  # a stopped pool holds no blocks
    assert '"msg": "signal received, stopping"' in pool.logs()
