"""A worker process's serve loop: the model loaded and calibrated on the engine thread, the gRPC
server, the Redis heartbeat, Prometheus metrics, and the drain on SIGTERM. Shared by
``prefill_worker`` and ``decode_worker``, which bring their servicer."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from collections.abc import Callable

import redis
import torch
from prometheus_client import REGISTRY, start_http_server

from core.grpc_service import GrpcService, run_until_signalled
from core.logging_setup import setup_logging
from core.registry import Heartbeat, WorkerInfo, WorkerRegistry, worker_key
from engine.async_engine import AsyncEngine, engine_thread
from engine.calibration import calibrate
from engine.config import EngineConfig
from engine.core_share import CoreShare
from engine.engine import LLMEngine
from engine.kv_connector import KVConnector, KVLoadFailurePolicy, KVLoadFailures, PoolIO, PoolLocator
from worker.config import WorkerConfig
from worker.metrics import GrammarCollector, WorkerCollector
from worker.stats import worker_load

log = logging.getLogger(__name__)


def _build_engine(worker: WorkerConfig, engine_config: EngineConfig, save_kv_on_finish: bool) -> LLMEngine:
    """Loads the model and calibrates the cost model (on the engine thread)."""
    log.info("loading model %s", engine_config.model)
    engine = LLMEngine.from_config(engine_config, save_kv_on_finish=save_kv_on_finish)
    if worker.calibration_steps:
        result = calibrate(engine, worker.calibration_steps, cache=True)
        model = engine.stats().cost_model
        log.info("cost model calibrated: %d passes %s in %.2f s; base %.2f ms, %.1f us/token, %.1f us/seq, "
                 "%.2f us/1k attention pairs", result.num_steps,
                 "read from this machine's cache" if result.cached else "timed", result.duration_s,
                 model.base_s * 1e3, model.per_token_s * 1e6, model.per_seq_s * 1e6, model.per_attn_s * 1e6)
    return engine


def _core_share(role: str, worker: WorkerConfig, engine: LLMEngine) -> CoreShare | None:
    """This worker's side of core sharing (engine.core_share), or None when off: no
    ``--core-share-dir``, or a tensor-parallel worker (its ranks' threads are fixed).

    Raises:
        ValueError: a decode worker given a directory but no ``--core-share-threads``.
    """
    if not worker.core_share_dir:
        return None
    if engine.parallel is not None:
        log.warning("--core-share-dir ignored: a tensor-parallel worker keeps its ranks' threads")
        return None
    if role == "decode" and worker.core_share_threads < 1:
        raise ValueError("a decode worker with --core-share-dir needs --core-share-threads >= 1 (the idle prefill "
                         f"workers' threads), got {worker.core_share_threads}")
    base = engine.config.num_threads or torch.get_num_threads()
    share = (CoreShare(worker.core_share_dir, "borrower", base, worker.core_share_threads) if role == "decode"
             else CoreShare(worker.core_share_dir, "owner", base))
    if role == "decode":  # a prompt chunk beside decodes shrinks with the cores it runs on
        full = base + worker.core_share_threads
        share.on_threads = lambda n: setattr(engine.scheduler, "mixed_prefill_share", n / full)
        # the prefill worker beside it hands streams over at any step: no step of local prompts
        # may run long while one waits for its second token
        engine.scheduler.decodes_may_join = True
    log.info("core sharing in %s: %s", worker.core_share_dir,
             f"{base} threads, {base + worker.core_share_threads} while prefill is idle" if role == "decode"
             else f"decode runs on these {base} threads while this worker is idle")
    return share


def serve_worker(
    role: str,
    worker: WorkerConfig,
    engine_config: EngineConfig,
    service_name: str,
    add_servicer: Callable[[GrpcService, AsyncEngine, KVConnector], None],
    save_kv_on_finish: bool,
) -> None:
    """Loads the model, serves ``service_name`` until SIGTERM, deregisters, drains in-flight
    RPCs, exits. ``role``: prefill or decode (its registry key and metrics label)."""
    setup_logging(f"{role}_worker", worker.log_level)
    worker_id = worker.worker_id or f"{role}-{socket.gethostname()}-{os.getpid()}"
    thread = engine_thread()  # torch runs on this one thread only (see engine.async_engine)
    engine = thread.submit(_build_engine, worker, engine_config, save_kv_on_finish).result()
    cores = _core_share(role, worker, engine)
    if engine.parallel is not None:  # a rank that dies takes the whole worker down
        fatal = _exit_on_rank_failure(worker.redis_url, worker_key(role, worker_id))
        engine.parallel.on_failure = lambda err: fatal(str(err))
        engine.parallel.processes.watch(lambda rank, code: fatal(f"tensor-parallel rank {rank} exited ({code})"))

    async def main() -> None:
        async_engine = AsyncEngine(engine, thread, cores)
        registry = WorkerRegistry(worker.redis_url)
        service = GrpcService(worker.host, worker.port, [service_name])
        failures = KVLoadFailures(KVLoadFailurePolicy(worker.kv_load_failure_policy))
        io = PoolIO(engine.spec, lease_ttl_s=worker.kv_lease_ttl_s, transfer=worker.kv_transfer)
        connector = KVConnector(engine.spec, PoolLocator(registry, worker.pool_address, worker.kv_transfer), io,
                                failures=failures)
        add_servicer(service, async_engine, connector)
        heartbeat: Heartbeat | None = None

        async def start() -> None:
            nonlocal heartbeat
            async_engine.start()
            port = await service.start()
            address = worker.advertise_address or f"{worker.host}:{port}"
            spec = engine.spec
            info = WorkerInfo(worker_id, role, address,
                              spec_fingerprint=spec.fingerprint, block_size=spec.block_size)
            heartbeat = Heartbeat(registry, info, lambda: worker_load(async_engine, connector.kv_load),
                                  worker.heartbeat_interval_s, worker.heartbeat_ttl_s)
            await heartbeat.start()
            if worker.metrics_port:  # vLLM-named gauges (worker.metrics) + KV transfer counters
                REGISTRY.register(WorkerCollector(lambda: worker_load(async_engine, connector.kv_load).to_wire(),
                                                  role, engine_config.model))
                REGISTRY.register(GrammarCollector(lambda: async_engine.engine.structured.stats, role))
                start_http_server(worker.metrics_port, addr=worker.host)
            log.info("serving %s on %s", service_name, address)

        async def stop() -> None:
            # NOT_SERVING before the registry entry goes: a router that finds the entry gone asks
            # the worker whether it still serves (its heartbeats may only be cut off from Redis)
            await service.report_not_serving()
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


def _exit_on_rank_failure(redis_url: str, registry_key: str) -> Callable[[str], None]:
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
            client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
            client.delete(registry_key)
        except redis.RedisError as err:
            log.warning("could not deregister (%s); the registry entry expires by its TTL", err)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    return fatal
