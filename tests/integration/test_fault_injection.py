"""core.fault_injection against a real pool server in this process: off without the fault file,
and each mode (delay, error, truncate, corrupt) does what it says to a real GetBlocks/GetStats."""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

from core.block_key import BlockKey
from core.fault_injection import ENV_VAR, FaultRule, write_rules
from core.pool_client import PoolClient
from core.grpc_service import aio_channel
from kv_pool.config import PoolConfig
from kv_pool.server import PoolServer
from tandem.v1 import kv_pool_pb2, kv_pool_pb2_grpc
from core.proto_convert import block_key_to_proto


@contextlib.asynccontextmanager
async def faulty_pool(redis_url: str, port: int, fault_file: str):
    """A pool server in this event loop, started with the fault file named in the environment."""
    server = PoolServer(PoolConfig(host="127.0.0.1", port=port, redis_url=redis_url, node_id=f"chaos-{port}",
                                   capacity_bytes=1 << 20))
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def get_all(address: str, key: BlockKey) -> list:
    async with aio_channel(address) as channel:
        stub = kv_pool_pb2_grpc.KVPoolStub(channel)
        return [m async for m in stub.GetBlocks(kv_pool_pb2.GetBlocksRequest(keys=[block_key_to_proto(key)]), timeout=10)]


async def test_each_fault_mode_on_a_real_pool(redis_url, free_port, tmp_path, monkeypatch):
    fault_file = str(tmp_path / "faults.json")
    monkeypatch.setenv(ENV_VAR, fault_file)
    async with faulty_pool(redis_url, free_port, fault_file) as server:
        await check_modes(server, fault_file)


async def check_modes(server: PoolServer, fault_file: str) -> None:
    key = BlockKey.content("fp-chaos", 7)
    data = bytes(range(256)) * 1024  # 256 KiB: one chunk
    client = PoolClient(server.address, timeout_s=10)  # blocking: each call in a thread
    await asyncio.to_thread(client.put_blocks, [(key, data)])
    assert b"".join(m.data for m in await get_all(server.address, key)) == data  # no file: no faults

    write_rules(fault_file, [FaultRule("corrupt", ("GetBlocks",))])
    (message,) = await get_all(server.address, key)
    assert message.data[0] == data[0] ^ 0xFF and message.data[1:] == data[1:]

    write_rules(fault_file, [FaultRule("error", ("GetStats",), code="DATA_LOSS")])
    with pytest.raises(grpc.RpcError) as info:
        await asyncio.to_thread(client.stats)
    assert info.value.code() is grpc.StatusCode.DATA_LOSS and info.value.details() == "chaos: injected DATA_LOSS"

    write_rules(fault_file, [FaultRule("delay", ("GetStats",), delay_s=0.3)])
    start = time.monotonic()
    assert (await asyncio.to_thread(client.stats))["num_stored_blocks"] == 1
    assert time.monotonic() - start >= 0.3

    write_rules(fault_file, [])
    assert (await asyncio.to_thread(client.stats))["num_stored_blocks"] == 1
    client.close()


def test_bad_rules_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="mode must be one of"):
        FaultRule("explode")
    with pytest.raises(ValueError, match="probability must be in \\[0, 1\\], got 2"):
        FaultRule("delay", probability=2)
    with pytest.raises(ValueError, match="code must be a grpc.StatusCode name, got 'NOPE'"):
        FaultRule("error", code="NOPE")
