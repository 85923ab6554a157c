"""The router process: OpenAI HTTP (uvicorn) and gRPC in one asyncio loop, sharing one generation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging

import uvicorn
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection

from core import tracing
from core.grpc_auth import api_key_gate
from core.grpc_service import STOP_MARGIN_S, GrpcService
from core.model_source import resolve_model
from core.registry import WorkerRegistry
from router.api.auth import ApiKeyMiddleware
from router.chat_templates import load_chat_template
from router.cluster_metrics import ClusterCollector
from router.config import RouterConfig
from router.placement.admission import Admission
from router.generation import Generation
from router.api.grpc_api import SERVICE_NAME, RouterServicer
from router.api.http_tracing import TracingMiddleware
from router.metrics import RouterMetrics
from router.api.openai_api import OpenAIApi
from router.placement.prediction import SLO
from router.placement.state import PlacementBook
from router.placement.placer import Placer
from router.placement.prefix_index import PoolPrefixIndex
from router.placement.policies import make_policy
from router.tokenizer import ModelTokenizer, load_tokenizer
from router.api.validation import Validator
from router.workers.clients import WorkerClients
from router.workers.view import WorkerView
from tandem.v1 import router_pb2_grpc

log = logging.getLogger(__name__)
STARTUP_TIMEOUT_S = 30.0
ABORT_FLUSH_S = 2.0  # requests ended at shutdown hand their last event to the front-ends by then


class _UvicornServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the router's run loop owns SIGTERM/SIGINT
        yield


class RouterServer:
    """Owns every piece of a running router; ``start`` then ``stop``.

    After ``start``, ``http_port`` and ``grpc_port`` are the bound ports (useful with port 0).
    """

    def __init__(self, config: RouterConfig, tokenizer: ModelTokenizer | None = None):
        self.config = config
        self.tokenizer = tokenizer  # loaded in start() when not given
        self.http_port = 0
        self.grpc_port = 0

    async def start(self) -> None:
        """Loads the tokenizer, starts watching the registry, then both servers.

        Raises:
            FileNotFoundError: the model or the chat template cannot be found.
            RuntimeError: a port cannot be bound, or HTTP did not come up.
        """
        config = self.config
        source = resolve_model(config.model, config.served_model_name or None)
        chat_template = load_chat_template(config.chat_template)
        self.metrics = RouterMetrics(source.name)  # its vllm: metrics labelled with the served name
        if self.tokenizer is None:
            self.tokenizer = await asyncio.to_thread(load_tokenizer, source)
        if chat_template is not None:
            self.tokenizer = dataclasses.replace(self.tokenizer, chat_template=chat_template)
        self.validator = Validator(self.tokenizer, source.name, config.max_model_len, config.default_max_tokens,
                                   config.tool_call_parser)
        self.registry = WorkerRegistry(config.redis_url)
        self.clients = WorkerClients(replaced_channel_grace_s=config.request_timeout_s)
        # A worker marked down after a failure comes back only once it answers health checks.
        self.view = WorkerView(self.registry, config.worker_refresh_interval_s, probe=self.clients.health)
        self.generation = Generation(
            self.view, self.clients, self.tokenizer, self.metrics, self._placer(), config.request_timeout_s,
            config.first_token_hold_s,
        )
        self.metrics.registry.register(ClusterCollector(self.view))  # the cluster view on /metrics
        await self.view.start()
        await self._start_grpc()
        await self._start_http()
        log.info("router serving %r: HTTP on %s:%d, gRPC on %s:%d", source.name,
                 config.host, self.http_port, config.host, self.grpc_port)

    def _placer(self) -> Placer:
        """The configured routing policy and SLO admission; the pool's prefix index read from
        the registry's Redis."""
        config = self.config
        slo = SLO(config.ttft_slo_s, config.tbt_slo_s)
        book = PlacementBook(config.prefix_cache_blocks)
        policy = make_policy(config.routing_policy, book.view, config.disaggregation, slo)
        admission = Admission(slo, config.max_queue_s)
        return Placer(book, policy, admission, self.metrics, PoolPrefixIndex(self.registry.redis))

    async def _start_grpc(self) -> None:
        gates = [api_key_gate(self.config.api_keys)] if self.config.api_keys else []
        self.grpc = GrpcService(self.config.host, self.config.grpc_port, [SERVICE_NAME], self.config.shutdown_grace_s,
                                internal=False, gates=gates)
        servicer = RouterServicer(self.validator, self.generation, self.metrics)
        router_pb2_grpc.add_RouterServicer_to_server(servicer, self.grpc.server)
        # Server reflection: grpcurl and other tools list and call the API without the .proto files.
        reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.grpc.server)
        self.grpc_port = await self.grpc.start()

    async def _start_http(self) -> None:
        app = OpenAIApi(self.validator, self.generation, self.view, self.metrics).app
        if self.config.api_keys:
            app.add_middleware(ApiKeyMiddleware, api_keys=self.config.api_keys, open_paths=self.config.open_paths)
        if tracing.enabled():  # outermost: a refused request is traced too
            app.add_middleware(TracingMiddleware)
        uv_config = uvicorn.Config(
            app, host=self.config.host, port=self.config.http_port, log_config=None, access_log=False,
            lifespan="off", timeout_graceful_shutdown=max(1, int(self.config.shutdown_grace_s)),
        )
        sock = uv_config.bind_socket()
        self.http_port = sock.getsockname()[1]
        self.uvicorn = _UvicornServer(uv_config)
        self._http_task = asyncio.create_task(self.uvicorn.serve(sockets=[sock]), name="router-http")
        deadline_s = asyncio.get_running_loop().time() + STARTUP_TIMEOUT_S
        while not self.uvicorn.started:
            if self._http_task.done() or asyncio.get_running_loop().time() > deadline_s:
                raise RuntimeError(f"HTTP server did not start on {self.config.host}:{self.http_port}")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Refuses new requests (HTTP 503, gRPC UNAVAILABLE, health 503 / NOT_SERVING), lets
        in-flight ones run for ``shutdown_grace_s``, ends the rest with a last event of their own
        (SSE abort chunk + ``{"error": {"code": "shutting_down"}}`` + ``[DONE]``, gRPC
        UNAVAILABLE "router shutting down"; router.shutdown), then stops both servers (no request
        is left for them to cut) and closes everything."""
        shutdown = self.generation.shutdown
        shutdown.begin()
        for name in ["", SERVICE_NAME]:
            await self.grpc.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if not await shutdown.wait_idle(self.config.shutdown_grace_s):
            log.warning("ending %d request(s) still running after the %g s grace period",
                        shutdown.num_running, self.config.shutdown_grace_s)
            shutdown.abort()
            await shutdown.wait_idle(ABORT_FLUSH_S)
        self.uvicorn.should_exit = True
        await asyncio.gather(self.grpc.stop(), self._stop_http(), return_exceptions=True)
        await self.view.stop()
        await self.clients.close()
        await self.registry.close()

    async def _stop_http(self) -> None:
        """Waits for uvicorn to stop (it cuts connections still open after its graceful
        timeout); past that and ``STOP_MARGIN_S`` it is cancelled, with a warning."""
        limit_s = self.uvicorn.config.timeout_graceful_shutdown + STOP_MARGIN_S
        try:
            await asyncio.wait_for(self._http_task, limit_s)
        except asyncio.TimeoutError:  # the builtin TimeoutError only from Python 3.11
            log.warning("the HTTP server on port %d had not stopped after %g s: cancelled", self.http_port, limit_s)
