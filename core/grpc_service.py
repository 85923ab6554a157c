"""Shared shape of every Tandem gRPC service: asyncio server, grpc.health.v1, clean SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from core.fault_injection import interceptors_from_env

log = logging.getLogger(__name__)

# KV blocks are large (SmolLM2-135M, fp32, block_size 16: 720 KiB); allow them whole.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def insecure_channel(address: str) -> grpc.Channel:
    """A blocking channel with Tandem's message limits."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def aio_channel(address: str) -> grpc.aio.Channel:
    """An asyncio channel with Tandem's message limits."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class GrpcService:
    """Runs servicers on ``host:port`` with health checking until SIGTERM/SIGINT.

    ``service_names`` are the fully-qualified gRPC service names (``tandem.v1.KVPool``) whose
    health is reported SERVING once started and NOT_SERVING while draining.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str], grace_s: float = 5.0):
        self.address = f"{host}:{port}"
        self.service_names = list(service_names)
        self.grace_s = grace_s
        # No SO_REUSEPORT (grpc sets it by default): a second server on a taken port must fail to
        # bind, not silently share the port's connections with the first.
        # interceptors: none in production; fault injection only under a chaos option (issue 16).
        self.server = grpc.aio.server(interceptors=interceptors_from_env(),
                                      options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)])
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.bound_port = 0

    async def start(self) -> int:
        """Binds and starts; returns the bound port (useful with port 0).

        Raises:
            RuntimeError: the address cannot be bound (the port is in use, or the host is not
                an interface of this machine); the message names the port.
        """
        try:
            self.bound_port = self.server.add_insecure_port(self.address)
        except RuntimeError:  # grpc >= 1.49 raises instead of returning 0
            self.bound_port = 0
        if self.bound_port == 0:
            port = self.address.rsplit(":", 1)[1]
            raise RuntimeError(f"cannot bind gRPC server to {self.address}: port {port} is in use "
                               "(another Tandem service?) or the host is not an interface of this machine")
        await self.server.start()
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.bound_port

    async def stop(self) -> None:
        """Reports NOT_SERVING, then stops after in-flight RPCs finish or ``grace_s`` passes."""
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.stop(self.grace_s)


async def run_until_signalled(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    """Awaits ``start()``, waits for SIGTERM or SIGINT, then awaits ``stop()``."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await start()
    await stopping.wait()
    log.info("signal received, stopping")
    await stop()
