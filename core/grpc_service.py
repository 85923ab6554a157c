"""Shared shape of every Tandem gRPC service: asyncio server, grpc.health.v1, clean SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import cache

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from core import grpc_auth, tracing
from core.fault_injection import interceptors_from_env
from core.grpc_auth import ClusterSecurity

log = logging.getLogger(__name__)

# KV blocks are large (SmolLM2-135M, fp32, block_size 16: 720 KiB); allow them whole.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


@cache
def process_security() -> ClusterSecurity:
    """This process's cluster credentials, read once from the environment (core.grpc_auth).

    Raises:
        ValueError: a file the variables name cannot be read, or they are inconsistent.
    """
    return ClusterSecurity.from_env()


def cluster_channel(address: str, security: ClusterSecurity | None = None,
                    options: Sequence[tuple] = CHANNEL_OPTIONS) -> grpc.Channel:
    """A blocking channel to a Tandem service (``options``: Tandem's message limits), over TLS
    and carrying the cluster token when ``security`` (default: :func:`process_security`) has them."""
    return grpc_auth.channel(address, options, security or process_security())


def cluster_aio_channel(address: str, security: ClusterSecurity | None = None,
                        options: Sequence[tuple] = CHANNEL_OPTIONS) -> grpc.aio.Channel:
    """The asyncio form of :func:`cluster_channel`."""
    return grpc_auth.aio_channel(address, options, security or process_security())


# Older names (plaintext and tokenless whenever the cluster has no credentials).
insecure_channel = cluster_channel
aio_channel = cluster_aio_channel


class GrpcService:
    """Runs servicers on ``host:port`` with health checking until SIGTERM/SIGINT.

    ``service_names`` are the fully-qualified gRPC service names (``tandem.v1.KVPool``) whose
    health is reported SERVING once started and NOT_SERVING while draining.

    An internal service (pool, workers) refuses RPCs without the cluster token (UNAUTHENTICATED)
    and serves TLS when ``security`` (default: :func:`process_security`) says so; a public one
    (the router) takes its ``gates`` instead (API keys, core.grpc_auth) and serves plaintext.
    ``grpc.health.v1`` stays open either way. With tracing on (core.tracing) every RPC gets a span.
    """

    def __init__(self, host: str, port: int, service_names: Iterable[str], grace_s: float = 5.0,
                 security: ClusterSecurity | None = None, internal: bool = True,
                 gates: Sequence[grpc.aio.ServerInterceptor] = ()):
        self.address = f"{host}:{port}"
        self.service_names = list(service_names)
        self.grace_s = grace_s
        security = (security or process_security()) if internal else ClusterSecurity()
        server_name = self.service_names[0] if self.service_names else "tandem"
        tracing.configure_from_env(server_name)  # OTEL_EXPORTER_OTLP_ENDPOINT set: traces on (once per process)
        interceptors = [tracing.TracingInterceptor(server_name)] if tracing.enabled() else []
        interceptors += list(gates)
        if security.token:
            interceptors.append(grpc_auth.cluster_gate(security.token))
        self._credentials = security.server_credentials()
        # No SO_REUSEPORT (grpc sets it by default): a second server on a taken port must fail to
        # bind, not silently share the port's connections with the first.
        # Fault injection only under a chaos option (core.fault_injection), never in production.
        interceptors += interceptors_from_env()
        self.interceptors = tuple(interceptors)
        self.server = grpc.aio.server(options=[*CHANNEL_OPTIONS, ("grpc.so_reuseport", 0)],
                                      interceptors=interceptors or None)
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
            if self._credentials is None:
                self.bound_port = self.server.add_insecure_port(self.address)
            else:
                self.bound_port = self.server.add_secure_port(self.address, self._credentials)
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
