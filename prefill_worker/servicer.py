"""tandem.v1.PrefillWorker: converts protobuf and delegates to the prefill flow."""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from core.failure_metadata import KV_SAVE_FAILURE_KEY
from core.proto_convert import block_key_to_proto, sampling_params_from_proto, token_logprob_to_proto
from core.request import Request
from engine.async_engine import AsyncEngine
from core.pool_ring import HashRing
from engine.kv_connector import KVConnector, KVLoadError, Manifest
from tandem.v1 import common_pb2, prefill_worker_pb2, prefill_worker_pb2_grpc
from worker.stats import stats_response

log = logging.getLogger(__name__)


def manifest_to_proto(manifest: Manifest) -> common_pb2.KVManifest:
    return common_pb2.KVManifest(
        spec_fingerprint=manifest.spec_fingerprint, pool_address=manifest.pool_address,
        blocks=[block_key_to_proto(k) for k in manifest.keys], num_tokens=manifest.num_tokens,
        kv_dtype=manifest.kv_dtype,
    )


class PrefillServicer(prefill_worker_pb2_grpc.PrefillWorkerServicer):
    """Prefill = the KV connector loads the cached prefix from the pool, the engine computes the
    rest and samples the first token, the connector writes the new blocks (full ones
    content-addressed, the tail request-scoped) leased to the request, and the answer carries
    the manifest: the request's pool state goes with it (``KVConnector.hand_off``). On any
    failure the connector releases what it holds. Nothing stays on the worker afterwards.

    A failed prefix load follows ``--kv-load-failure-policy`` (engine.kv_connector.load_failure):
    recompute the whole prompt, or end with ``UNAVAILABLE`` and the reason in trailing metadata."""

    def __init__(self, engine: AsyncEngine, connector: KVConnector):
        self.engine = engine
        self.connector = connector
        self.num_cached_tokens = 0

    async def Prefill(self, request, context):
        rid = request.request_id
        started = time.monotonic()
        try:
            params = sampling_params_from_proto(request.sampling_params)
            engine_request = Request(rid, list(request.prompt_token_ids), dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1)))
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        try:
            ring = await self.connector.ring()  # the pool nodes; each block goes to its node
        except LookupError as err:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err))
        try:
            response = await self._prefill(engine_request, ring, started)
        except KVLoadError as err:  # the prefix load failed under --kv-load-failure-policy fail
            await self.connector.release(rid)
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err), err.trailing_metadata)
        except (grpc.RpcError, OSError) as err:  # writing the new blocks failed: the pool broke, not us
            await self.connector.release(rid)
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV pool write failed: {err}",
                                ((KV_SAVE_FAILURE_KEY, "pool_write_failed"),))
        except ValueError as err:
            await self.connector.release(rid)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except BaseException:  # cancelled by the router, or the pool failed: leave nothing behind
            await self.connector.release(rid)
            raise
        if self._ends_with_first_token(request, params, response.first_token_id):
            await self.connector.release(rid)  # the router sends no Decode: no one else will
        else:
            self.connector.hand_off(rid)  # the manifest's holder (the decode worker) releases it
        return response

    def _ends_with_first_token(self, request, params, first_token_id: int) -> bool:
        """True when the request's own stop rule ends it at its first token (max_tokens 1, or a
        stop token past min_tokens): the router then streams it and decodes nothing."""
        probe = Request(request.request_id, list(request.prompt_token_ids), params,
                        eos_token_id=self.engine.eos_token_id)
        return probe.append_output_token(first_token_id) is not None

    async def _prefill(self, request: Request, ring: HashRing, started: float):
        rid = request.request_id
        # Prompt logprobs need the logits of every prompt position: no cached prefix is loaded.
        wants_prompt_logprobs = request.sampling_params.prompt_logprobs is not None
        cached = None if wants_prompt_logprobs else await self.connector.load_cached_prefix(
            rid, request.prompt_token_ids, ring)
        output = None
        async for output in self.engine.generate(request, cached):
            pass
        assert output is not None and output.finished and output.saved_kv is not None
        keys = self.connector.prompt_keys(rid, request.prompt_token_ids)
        await self.connector.save(rid, ring, keys, output.saved_kv, skip=len(cached.payloads) if cached else 0)
        self.num_cached_tokens += output.num_cached_tokens
        manifest = self.connector.manifest(ring, keys, request.num_prompt_tokens)
        response = prefill_worker_pb2.PrefillResponse(
            first_token_id=output.new_token_ids[0],
            num_cached_tokens=output.num_cached_tokens,
            manifest=manifest_to_proto(manifest),
            prefill_time_s=time.monotonic() - started,
        )
        if output.logprobs:
            first = output.logprobs[0]
            response.first_token_logprob.CopyFrom(token_logprob_to_proto(first.token_id, first.logprob, first.top_logprobs))
        response.prompt_logprobs.extend(token_logprob_to_proto(s.token_id, s.logprob, s.top_logprobs)
                                        for s in output.prompt_logprobs or ())
        return response

    async def GetStats(self, request, context):
        return stats_response(self.engine, self.connector.kv_load, num_cached_tokens=self.num_cached_tokens)
