"""The load a worker publishes (heartbeat, /metrics) and its GetStats reply."""

from __future__ import annotations

import dataclasses

from core.cost_model import BandwidthMeter
from core.proto_convert import worker_stats_to_proto
from core.worker_load import WorkerLoad
from engine.async_engine import AsyncEngine
from tandem.v1 import prefill_worker_pb2


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
