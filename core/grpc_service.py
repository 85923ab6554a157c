"""Shared shape of every Tandem gRPC service: asyncio server, grpc.health.v1, clean SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import cache
from typing import NoReturn

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from core import grpc_auth, tracing
from core.fault_injection import interceptors_from_env
from core.grpc_auth import ClusterSecurity

log = logging.getLogger(__name__)

# KV blocks are large (SmolLM2-135M, fp32, block_size 16: 720 KiB); allow them whole.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# HTTP/2 keepalive pings on every cluster channel, calls or not: a peer that stops answering
# without closing the connection (a silent partition, a dropped NetworkPolicy, a hung host) is
# detected within 2 x KEEPALIVE_TIME_S + KEEPALIVE_TIMEOUT_S = 9 s (a ping waits out the interval
# since the previous one, then its timeout; measured 7.0 s as set, 1.5 s with 0.5 s + 0.5 s), and
# its calls fail UNAVAILABLE (the router then resumes the stream elsewhere) instead of hanging
# until TCP gives up (~15 min).
# gRPC core answers pings on its own threads, so a worker busy in a long step still answers; the
# 5 s timeout leaves room for a process starved of CPU on a loaded machine.
KEEPALIVE_TIME_S = 2.0
KEEPALIVE_TIMEOUT_S = 5.0
# After its grace period a stopping server cancels the calls still running; a server that has not
# stopped this much later (a call gRPC core still counts, a handler that ignores its cancellation)
# is left behind with a warning, so stopping a service never hangs.
STOP_MARGIN_S = 5.0


def keepalive_channel_options(time_s: float = KEEPALIVE_TIME_S, timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple]:
    """Client-side keepalive: a ping every ``time_s``, the connection closed when one is not
    answered within ``timeout_s``; pings go on while no data flows (a server stream whose peer
    fell silent sends nothing, and gRPC's default stops pinging after two such pings). gRPC 1.85
    times a ping out by ``grpc.http2.ping_timeout_ms`` (default 60 s), not by the keepalive
    timeout alone, so both are set."""
    return [("grpc.keepalive_time_ms", int(time_s * 1000)), ("grpc.keepalive_timeout_ms", int(timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0)]


def keepalive_server_options(time_s: float = KEEPALIVE_TIME_S, timeout_s: float = KEEPALIVE_TIMEOUT_S) -> list[tuple]:
    """Server-side keepalive: the server pings its clients as they ping it (a router that fell
    silent frees its streams' KV in bounded time too), and accepts their pings at ``time_s``
    (gRPC's default policy answers pings more often than every 5 minutes with GOAWAY)."""
    return [*keepalive_channel_options(time_s, timeout_s),
            ("grpc.http2.min_ping_interval_without_data_ms", int(time_s * 1000) // 2),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", int(time_s * 1000) // 2),
            ("grpc.http2.max_ping_strikes", 0)]


CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *keepalive_channel_options(),
]
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *keepalive_server_options(),
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
                 gates: Sequence[grpc.aio.ServerInterceptor] = (), server_options: Sequence[tuple] | None = None):
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
        self.server = grpc.aio.server(options=[*(server_options or SERVER_OPTIONS), ("grpc.so_reuseport", 0)],
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

    async def report_not_serving(self) -> None:
        """Every health check answers NOT_SERVING from now on (a draining server); RPCs still run."""
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self) -> None:
        """Reports NOT_SERVING, then stops after in-flight RPCs finish or ``grace_s`` passes (the
        rest are cancelled). Returns within ``grace_s + STOP_MARGIN_S`` even when the server does
        not stop (logged as a warning)."""
        await self.report_not_serving()
        try:
            await asyncio.wait_for(self.server.stop(self.grace_s), self.grace_s + STOP_MARGIN_S)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            log.warning("the gRPC server on %s had not stopped %g s after its %g s grace period: left behind",
                        self.address, STOP_MARGIN_S, self.grace_s)


def freeze_start_up_heap() -> int:
    """Collects once, then moves every object still alive (the model and its modules, the imported
    libraries: ~400,000 in a worker) out of the cyclic collector's reach (``gc.freeze``), as
    vLLM's engine does after its start-up. Python's oldest-generation collection walks every
    tracked object: 189 ms in a SmolLM2-135M worker (2-core AMD Zen 4), a pause of the engine
    thread that a token stream sees as one long gap, triggered by the objects serving allocates.
    After the freeze it walks only what serving made. Returns the number of frozen objects."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def run_until_signalled(
    start: Callable[[], Awaitable[None]], stop: Callable[[], Awaitable[None]]
) -> None:
    """Awaits ``start()``, freezes the start-up heap (:func:`freeze_start_up_heap`), waits for
    SIGTERM or SIGINT, then awaits ``stop()``. When ``start()`` raises, ``stop()`` still runs
    (what started, such as a gRPC server or the engine thread, would otherwise keep the process
    alive and unready) and the error propagates."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await start()
    except BaseException:
        log.error("start-up failed: stopping what had started")
        try:
            await stop()
        except Exception as err:  # the start-up error is the one to report
            log.warning("stopping after the failed start-up: %s: %s", type(err).__name__, err)
        raise
    log.info("froze %d start-up objects out of the garbage collector's passes", freeze_start_up_heap())
    await stopping.wait()
    log.info("signal received, stopping")
    await stop()


def exit_after(main: Callable[[], object]) -> NoReturn:
    """``python -m <service>``: runs the service's command ``main`` (a click command: it ends with
    SystemExit), then ends the process with that exit code at once, its logs and stdio flushed.

    The interpreter's own teardown is skipped: once :func:`run_until_signalled`'s ``stop()`` has
    drained and closed everything, it only frees memory the exit frees anyway, and its collector
    passes walk every object torch and transformers made: 3 to 4.5 s after each worker's stop
    (1.2 to 1.6 s after the router's) on a 2-core machine, in which the launcher waits for the
    process (launcher.processes.stop, one service after another). An exception other than
    SystemExit propagates: the interpreter prints it and exits as usual."""
    try:
        main()
        code: object = 0
    except SystemExit as done:
        code = done.code
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # what the interpreter does with SystemExit("message")
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code or 0)
