"""tandem.v1.PrefillWorker: converts protobuf and delegates to the prefill flow."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from core.proto_convert import block_key_to_proto, sampling_params_from_proto, token_logprob_to_proto
from core.request import Request
from engine.async_engine import AsyncEngine
from engine.outputs import ExternalKV
from core.pool_ring import HashRing
from engine.pool_io import PoolIO
from engine.worker_runtime import PoolLocator, stats_response
from tandem.v1 import common_pb2, prefill_worker_pb2, prefill_worker_pb2_grpc

log = logging.getLogger(__name__)


class PrefillServicer(prefill_worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill = load the cached prefix from the pool, compute the rest, sample the first token,
    write the new blocks (full ones content-addressed, the tail request-scoped) leased to the
    request, and answer with a manifest. Nothing stays on the worker afterwards."""

    def __init__(self, engine: AsyncEngine, pool: PoolLocator):
        self.engine = engine
        self.pool = pool
        self.io = PoolIO(engine.engine.spec, transfer=pool.kv_transfer)
        self.num_cached_tokens = 0

    async def Prefill(self, request, context):
        rid = request.request_id
        started = time.monotonic()
        try:
            params = sampling_params_from_proto(request.sampling_params, default_temperature=0.0)
            engine_request = Request(rid, list(request.prompt_token_ids), dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            ring = await self.pool.ring()  # the pool nodes; each block goes to its node
        except LookupError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        hashes, keys = self.io.prompt_keys(rid, engine_request.prompt_token_ids)
        try:
            return await self._prefill(engine_request, ring, hashes, keys, started)
        except ValueError as err:
            await self.io.release(ring, rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except BaseException:  # cancelled by the router, or the pool failed: leave nothing behind
            await self.io.release(ring, rid)
            raise

    async def _prefill(self, request: Request, ring: HashRing, hashes, keys, started: float):
        load_started = time.perf_counter()
        cached = await self.io.load_cached_prefix(ring, request.request_id, hashes)
        if cached:  # the router's KV-load estimate: bytes / this measured bandwidth
            self.engine.kv_load.record(len(cached) * self.io.spec.block_bytes, time.perf_counter() - load_started)
        bs = self.engine.engine.config.block_size
        external = ExternalKV(len(cached) * bs, cached) if cached else None
        output = None
        async for output in self.engine.generate(request, external):
            pass
        assert output is not None and output.finished and output.saved_kv is not None
        await self.io.store(ring, request.request_id, keys, output.saved_kv, skip=len(cached))
        self.num_cached_tokens += output.num_cached_tokens
        manifest = common_pb2.KVManifest(
            spec_fingerprint=self.engine.engine.spec.fingerprint,
            # One node: its address. Several: "" (the decode worker places keys on its own ring,
            # the router releases the request on every node).
            pool_address=ring.addresses[0] if len(ring.nodes) == 1 else "",
            blocks=[block_key_to_proto(k) for k in keys],
            num_tokens=request.num_prompt_tokens,
        )
        response = prefill_worker_pb2.PrefillResponse(
            first_token_id=output.new_token_ids[0],
            num_cached_tokens=output.num_cached_tokens,
            manifest=manifest,
            prefill_time_s=time.monotonic() - started,
        )
        if output.logprobs:
            first = output.logprobs[0]
            response.first_token_logprob.CopyFrom(token_logprob_to_proto(first.token_id, first.logprob, first.top_logprobs))
        return response

    async def GetStats(self, request, context):
        return stats_response(self.engine, num_cached_tokens=self.num_cached_tokens)
