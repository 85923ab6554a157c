"""What prefill and decode workers share: engine flags, the pool address, the serve loop.

Workers import this (and ``core``), never each other.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import click
import redis
from prometheus_client import REGISTRY, start_http_server

from core.cost_model import BandwidthMeter
from core.grpc_service import GrpcService, run_until_signalled
from core.logging_setup import setup_logging
from core.proto_convert import worker_stats_to_proto
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry, worker_key
from core.worker_load import WorkerLoad
from engine.async_engine import AsyncEngine, engine_thread
from engine.calibration import calibrate
from engine.config import LINEAR_BACKEND_CHOICES, EngineConfig
from engine.engine import LLMEngine
from engine.kv_connector import KVConnector, KVLoadFailurePolicy, KVLoadFailures, PoolLocator
from engine.worker_metrics import WorkerCollector
from tandem.v1 import prefill_worker_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """Process-level settings of a worker (the engine's are in EngineConfig)."""

    role: str
    host: str
    port: int
    redis_url: str
    pool_address: str  # empty: found through the registry
    worker_id: str
    advertise_address: str  # empty: host:bound_port
    metrics_port: int
    kv_transfer: str = "auto"  # how KV bytes reach the pool: auto, grpc, shm, nixl (core.kv_transfer)
    # A failed KV load from the pool: recompute or fail the request (engine.kv_connector.load_failure).
    kv_load_failure_policy: str = "recompute"
    heartbeat_interval_s: float = 1.0
    # Synthetic passes timed at start-up so the cost model is fitted before traffic (0: none).
    calibration_steps: int = 16
    heartbeat_ttl_s: float = 3.0


def engine_options(f):
    """Click options for EngineConfig, shared by both workers (env ``TANDEM_<ROLE>_<FLAG>``)."""
    d = EngineConfig()
    options = [
        click.option("--model", default=d.model, show_default=True, help="Bundled name, .gguf file or HF folder."),
        click.option("--dtype", default=d.dtype, show_default=True, type=click.Choice(["float32", "float16", "bfloat16"])),
        click.option("--device", default=d.device, show_default=True),
        click.option("--block-size", default=d.block_size, show_default=True, type=int),
        click.option("--num-kv-blocks", default=d.num_kv_blocks, show_default=True, type=int),
        click.option("--max-num-seqs", default=d.max_num_seqs, show_default=True, type=int),
        click.option("--max-num-batched-tokens", default=d.max_num_batched_tokens, show_default=True, type=int),
        click.option("--max-model-len", default=d.max_model_len, show_default=True, type=int),
        click.option("--attention-backend", default=d.attention_backend, show_default=True,
                     type=click.Choice(["auto", "torch", "cpu", "triton"]),
                     help="auto: triton on CUDA, cpu elsewhere; torch is the readable reference."),
        click.option("--linear-backend", default=d.linear_backend, show_default=True,
                     type=click.Choice(list(LINEAR_BACKEND_CHOICES)),
                     help="GEMM backend of the linear layers; auto measures them once per machine on the "
                          "model's shapes and keeps the fastest per shape and batch size."),
        click.option("--enforce-eager/--no-enforce-eager", default=None,
                     help="Eager model (--enforce-eager) or torch.compile'd per layer (--no-enforce-eager; "
                          "~5-10 s on the first start, cached afterwards). Default: compiled on CUDA, eager "
                          "on the CPU, where compiling measured no faster."),
        click.option("--num-threads", default=d.num_threads, show_default=True, type=int,
                     help="torch intra-op threads (0: torch's default)."),
        click.option("--seed", default=d.seed, show_default=True, type=int),
        click.option("--scheduling-policy", default=d.scheduling_policy, show_default=True,
                     type=click.Choice(["continuous", "static"]),
                     help="continuous (Orca) or static batching (the baseline)."),
        click.option("--enable-prefix-caching/--no-enable-prefix-caching", default=d.enable_prefix_caching,
                     show_default=True, help="Reuse identical prompt prefixes in this worker's KV cache."),
        click.option("--enable-chunked-prefill/--no-enable-chunked-prefill", default=d.enable_chunked_prefill,
                     show_default=True, help="Split prompts over steps to fit the token budget."),
        click.option("--num-scheduler-steps", default=d.num_scheduler_steps, show_default=True, type=int,
                     help="Decode passes per scheduling decision (multi-step)."),
        click.option("--enable-overlap/--no-enable-overlap", default=d.enable_overlap, show_default=True,
                     help="Schedule step k+1 while step k runs."),
        click.option("--tensor-parallel-size", default=d.tensor_parallel_size, show_default=True,
                     type=click.IntRange(min=1),
                     help="Rank processes sharding the model (one GPU each on CUDA; gloo on the CPU). "
                          "--num-threads is per rank."),
        click.option("--preemption-mode", default=d.preemption_mode, show_default=True,
                     type=click.Choice(["swap", "recompute"]),
                     help="A preempted request's KV: swapped to the pool (or host memory) or recomputed."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def worker_options(default_port: int):
    def wrap(f):
        options = [
            click.option("--host", default="127.0.0.1", show_default=True),
            click.option("--port", default=default_port, show_default=True, type=int, help="0 picks a free port."),
            click.option("--redis-url", default="redis://127.0.0.1:6379/0", show_default=True),
            click.option("--pool-address", default="", help="KV pool host:port (default: found in Redis)."),
            click.option("--worker-id", default="", help="Default: <role>-<hostname>-<pid>."),
            click.option("--advertise-address", default="", help="Address others dial (default: host:port)."),
            click.option("--metrics-port", default=0, type=int, help="Prometheus port (0: off)."),
            click.option("--kv-transfer", default="auto", show_default=True,
                         type=click.Choice(["auto", "grpc", "shm", "nixl"]),
                         help="KV transfer to the pool; auto: shm on the pool's host, else nixl, else grpc."),
            click.option("--kv-load-failure-policy", default="recompute", show_default=True,
                         type=click.Choice([p.value for p in KVLoadFailurePolicy]),
                         help="A KV load from the pool that fails (unreachable, transfer error, checksum, lost "
                              "lease): recompute the KV here, or fail the request (gRPC UNAVAILABLE). Counted "
                              "in tandem:kv_load_failures_total."),
            click.option("--calibration-steps", default=16, show_default=True, type=click.IntRange(min=0),
                         help="Synthetic passes timed at start-up to fit the cost model (0: off; at most ~5 s)."),
            click.option("--log-level", default="INFO", show_default=True),
        ]
        for option in reversed(options):
            f = option(f)
        return f

    return wrap


def split_config(role: str, kwargs: dict) -> tuple[WorkerConfig, EngineConfig, str]:
    """Splits click kwargs into worker config, engine config and the log level."""
    engine_keys = set(EngineConfig.__dataclass_fields__)
    engine_config = EngineConfig(**{k: v for k, v in kwargs.items() if k in engine_keys})
    worker = WorkerConfig(
        role=role,
        host=kwargs["host"],
        port=kwargs["port"],
        redis_url=kwargs["redis_url"],
        pool_address=kwargs["pool_address"],
        worker_id=kwargs["worker_id"] or f"{role}-{socket.gethostname()}-{os.getpid()}",
        advertise_address=kwargs["advertise_address"],
        metrics_port=kwargs["metrics_port"],
        kv_transfer=kwargs["kv_transfer"],
        kv_load_failure_policy=kwargs.get("kv_load_failure_policy", "recompute"),
        calibration_steps=kwargs.get("calibration_steps", 16),
    )
    return worker, engine_config, kwargs["log_level"]




def worker_load(engine: AsyncEngine, kv_load: BandwidthMeter) -> WorkerLoad:
    """The live load a worker publishes in its heartbeat and GetStats: the engine's last
    snapshot with ``kv_load`` (the worker's KV connector's measured pool -> worker bandwidth)
    filled into its cost model."""
    load = engine.stats()
    cost = dataclasses.replace(load.cost_model, kv_load_bytes_per_s=kv_load.bytes_per_s)
    return dataclasses.replace(load, cost_model=cost)


def stats_response(
    engine: AsyncEngine, kv_load: BandwidthMeter, num_cached_tokens: int = 0
) -> prefill_worker_pb2.GetWorkerStatsResponse:
    """The GetStats reply both workers give."""
    return worker_stats_to_proto(worker_load(engine, kv_load), engine.num_prompt_tokens, num_cached_tokens,
                                 engine.num_generated_tokens)


def _build_engine(worker: WorkerConfig, engine_config: EngineConfig, save_kv_on_finish: bool) -> LLMEngine:
    """Loads the model and calibrates the cost model (on the engine thread)."""
    log.info("loading model %s", engine_config.model)
    engine = LLMEngine.from_config(engine_config, save_kv_on_finish=save_kv_on_finish)
    if worker.calibration_steps:
        result = calibrate(engine, worker.calibration_steps)
        model = engine.stats().cost_model
        log.info("cost model calibrated: %d passes in %.2f s; base %.2f ms, %.1f us/token, %.1f us/seq, "
                 "%.2f us/1k attention pairs", result.num_steps, result.duration_s, model.base_s * 1e3,
                 model.per_token_s * 1e6, model.per_seq_s * 1e6, model.per_attn_s * 1e6)
    return engine


def serve_worker(
    worker: WorkerConfig,
    engine_config: EngineConfig,
    log_level: str,
    service_name: str,
    add_servicer: Callable[[GrpcService, AsyncEngine, KVConnector], None],
    save_kv_on_finish: bool,
) -> None:
    """Loads the model, serves until SIGTERM, deregisters, drains in-flight RPCs, exits."""
    setup_logging(f"{worker.role}_worker", log_level)
    thread = engine_thread()  # torch runs on this one thread only (see engine.async_engine)
    engine = thread.submit(_build_engine, worker, engine_config, save_kv_on_finish).result()
    if engine.parallel is not None:  # a rank that dies takes the whole worker down
        fatal = _exit_on_rank_failure(worker)
        engine.parallel.on_failure = lambda err: fatal(str(err))
        engine.parallel.processes.watch(lambda rank, code: fatal(f"tensor-parallel rank {rank} exited ({code})"))

    async def main() -> None:
        async_engine = AsyncEngine(engine, thread)
        registry = WorkerRegistry(worker.redis_url)
        service = GrpcService(worker.host, worker.port, [service_name])
        failures = KVLoadFailures(KVLoadFailurePolicy(worker.kv_load_failure_policy))
        connector = KVConnector(engine.spec, PoolLocator(registry, worker.pool_address, worker.kv_transfer),
                                failures=failures)
        add_servicer(service, async_engine, connector)
        heartbeat: Heartbeat | None = None

        async def start() -> None:
            nonlocal heartbeat
            async_engine.start()
            port = await service.start()
            address = worker.advertise_address or f"{worker.host}:{port}"
            spec = engine.spec
            info = WorkerInfo(worker.worker_id, worker.role, address,
                              spec_fingerprint=spec.fingerprint, block_size=spec.block_size)
            heartbeat = Heartbeat(registry, info, lambda: worker_load(async_engine, connector.kv_load),
                                  worker.heartbeat_interval_s, worker.heartbeat_ttl_s)
            await heartbeat.start()
            if worker.metrics_port:  # vLLM-named gauges (engine.worker_metrics) + KV transfer counters
                REGISTRY.register(WorkerCollector(lambda: worker_load(async_engine, connector.kv_load).to_wire(),
                                                  worker.role, engine_config.model))
                start_http_server(worker.metrics_port, addr=worker.host)
            log.info("serving %s on %s", service_name, address)

        async def stop() -> None:
            if heartbeat is not None:
                await heartbeat.stop()  # no new traffic
            await service.stop()  # drain in-flight RPCs
            # Tensor-parallel ranks are stopped by the engine thread, after its step loop ends: they
            # were forked from it and die with it (PR_SET_PDEATHSIG), and only it talks to them.
            shutdown = thread.submit(engine.shutdown)
            async_engine.stop()
            shutdown.result(timeout=30)
            connector.close()
            await registry.close()

        await run_until_signalled(start, stop)

    asyncio.run(main())


def _exit_on_rank_failure(worker: WorkerConfig) -> Callable[[str], None]:
    """What a tensor-parallel worker does when one of its ranks dies: deregister at once (the
    router stops sending it work), then exit with code 1 without draining. Its open streams
    break, so the router migrates them (docs/failover.md), and ``tandem up`` (or Kubernetes)
    restarts the whole worker; the other ranks die with this process (PR_SET_PDEATHSIG).
    Draining is pointless: no pass can run without the dead rank's shard."""
    lock = threading.Lock()

    def fatal(reason: str) -> None:
        lock.acquire()  # the watcher and the step loop may both get here: the second waits for the exit
        log.error("%s: deregistering and exiting", reason)
        try:
            client = redis.Redis.from_url(worker.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            client.delete(worker_key(worker.role, worker.worker_id))
        except redis.RedisError as err:
            log.warning("could not deregister (%s); the registry entry expires by its TTL", err)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    return fatal
