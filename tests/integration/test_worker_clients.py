"""router.workers.clients against a real gRPC server that dies and comes back on the same port."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from router.workers.clients import WorkerClients
from router.workers.view import Health
from tests.conftest import find_free_port

WAIT_S = 10.0


async def _health_server(port: int) -> grpc.aio.Server:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)  # SERVING
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    return server


async def test_a_worker_restarted_on_its_port_is_reached_at_once() -> None:
    port = find_free_port()
    address = f"127.0.0.1:{port}"
    clients = WorkerClients()
    server = await _health_server(port)
    try:
        assert await clients.health(address) is Health.SERVING
        await server.stop(0)
        for _ in range(3):  # the router keeps probing a dead worker; nothing listens
            assert await clients.health(address) is Health.NOT_SERVING
        channel = clients._channels[address]  # the cached one: backing off before it reconnects

        async def backing_off() -> None:
            while channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                await channel.wait_for_state_change(channel.get_state())

        await asyncio.wait_for(backing_off(), WAIT_S)
        server = await _health_server(port)  # the worker is back, same address
        # Neither the old channel's reconnect backoff nor its subchannel's delays this call.
        assert await clients.health(address) is Health.SERVING
    finally:
        await server.stop(0)
        await clients.close()
