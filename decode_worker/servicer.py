"""tandem.v1.DecodeWorker: converts protobuf and delegates to the decode flow."""

from __future__ import annotations

import logging
import time

import grpc

from core.proto_convert import (
    block_key_from_proto, finish_reason_to_proto, sampling_params_from_proto, token_logprob_to_proto,
)
from core.request import Request
from engine.async_engine import AsyncEngine
from engine.outputs import ExternalKV
from engine.pool_io import PoolIO
from engine.worker_runtime import PoolLocator, stats_response
from tandem.v1 import decode_worker_pb2, decode_worker_pb2_grpc

log = logging.getLogger(__name__)

def _finished(request: Request) -> decode_worker_pb2.DecodeResponse:
    return decode_worker_pb2.DecodeResponse(
        finished=decode_worker_pb2.Finished(
            finish_reason=finish_reason_to_proto(request.finish_reason), num_output_tokens=request.num_output_tokens
        )
    )


def _append_outputs(request: Request, output_token_ids) -> None:
    """Appends a resumed request's tokens so far (they count toward max_tokens and min_tokens).
    Raises ValueError when they run past the request's end (a stop token or max_tokens before
    the last one)."""
    for i, token_id in enumerate(output_token_ids):
        if request.append_output_token(token_id) is not None and i < len(output_token_ids) - 1:
            raise ValueError(f"output_token_ids end the request at index {i} of {len(output_token_ids)} "
                             f"({request.finish_reason.value})")


class DecodeServicer(decode_worker_pb2_grpc.DecodeWorkerServicer):
    """Disaggregated decode: fetch the manifest's blocks from the pool (off the step loop),
    release the request in the pool, join the running batch at the next step, stream every new
    token. Colocated (no manifest): prefill here in chunks mixed into the decode steps
    (Sarathi-Serve), then decode; every token is streamed, the first included. Resumed
    (``output_token_ids``, after another decode worker failed): load the longest prefix of prompt
    + those tokens stored in the pool, recompute the rest in chunks, stream only new tokens."""

    def __init__(self, engine: AsyncEngine, pool: PoolLocator):
        self.engine = engine
        self.pool = pool
        self.io = PoolIO(engine.engine.spec, transfer=pool.kv_transfer)

    async def Decode(self, request, context):
        try:
            engine_request, keys = self._convert(request)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        external = None
        if request.HasField("first_token_id"):  # disaggregated: the prompt's KV is in the pool
            if engine_request.append_output_token(request.first_token_id) is not None:
                yield _finished(engine_request)  # the first token already ends it
                return
            external = await self._fetch_prompt_kv(request, keys, context)
        elif request.output_token_ids:  # resumed: the tokens so far are outputs, not prompt
            if engine_request.is_finished:
                yield _finished(engine_request)
                return
            external = await self._load_resumed_kv(engine_request)
        # A cancelled stream parked at `yield` gets no exception in this handler: abort from the
        # RPC's done callback instead (a no-op once the request finished).
        context.add_done_callback(lambda _: self.engine.abort(request.request_id))
        try:
            async for output in self.engine.generate(engine_request, external):
                if output.new_token_ids:
                    logprobs = [token_logprob_to_proto(s.token_id, s.logprob, s.top_logprobs) for s in output.logprobs]
                    tokens = decode_worker_pb2.TokenChunk(token_ids=output.new_token_ids, logprobs=logprobs)
                    yield decode_worker_pb2.DecodeResponse(tokens=tokens)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        yield _finished(engine_request)

    async def _fetch_prompt_kv(self, request, keys, context) -> ExternalKV | None:
        """Pulls the manifest's blocks (off the step loop), then ends the request in the pool.

        Whatever the pool cannot give (it died, a block is gone or fails its checksum) is
        recomputed here: the engine prefills what the returned ExternalKV does not cover.
        """
        manifest = request.manifest
        rid = request.request_id
        payloads: list[bytes] = []
        pool = manifest.pool_address  # one node; "" when blocks are spread over the pool's ring
        try:
            if not pool:
                pool = await self.pool.ring()
            fetch_started = time.perf_counter()
            payloads = await self.io.fetch(pool, keys, rid)
            if payloads:  # the router's KV-load estimate: bytes / this measured bandwidth
                self.engine.kv_load.record(len(payloads) * self.io.spec.block_bytes, time.perf_counter() - fetch_started)
        except (grpc.RpcError, OSError, LookupError) as err:
            log.warning("KV pool fetch failed (%s); recomputing the prompt", err, extra={"request_id": rid})
        finally:
            try:
                if pool:
                    await self.io.release(pool, rid)
            except grpc.RpcError:  # a dead pool holds nothing of ours any more
                log.warning("KV pool release failed", extra={"request_id": rid})
        return self._external_kv(manifest.num_tokens, keys, payloads)

    async def _load_resumed_kv(self, request: Request) -> ExternalKV | None:
        """KV of the longest prefix of prompt + outputs stored in the pool (full blocks only: in
        practice the prompt's, written by the prefill worker); None when the pool has none or
        cannot be reached. The engine recomputes everything after it."""
        rid = request.request_id
        hashes, _ = self.io.prompt_keys(rid, request.all_token_ids)
        payloads: list[bytes] = []
        try:
            ring = await self.pool.ring()
        except LookupError:
            return None
        try:
            payloads = await self.io.load_cached_prefix(ring, rid, hashes)
        except (grpc.RpcError, OSError) as err:
            log.warning("KV pool fetch failed (%s); recomputing", err, extra={"request_id": rid})
        finally:
            try:
                await self.io.release(ring, rid)
            except grpc.RpcError:
                log.warning("KV pool release failed", extra={"request_id": rid})
        num_loaded = len(payloads) * self.engine.engine.spec.block_size
        log.info("resuming after %d output tokens: %d of %d tokens loaded from the pool, the rest recomputed",
                 request.num_output_tokens, num_loaded, request.num_tokens, extra={"request_id": rid})
        return ExternalKV(num_loaded, payloads) if payloads else None

    def _external_kv(self, num_tokens: int, keys: list, payloads: list[bytes]) -> ExternalKV | None:
        """The fetched KV; when the pool gave only a prefix (a block missing or corrupt), the
        verified full blocks, and the engine prefills the rest locally."""
        if len(payloads) == len(keys):
            return ExternalKV(num_tokens, payloads)
        log.warning("pool gave %d of %d blocks; recomputing the rest", len(payloads), len(keys))
        return ExternalKV(len(payloads) * self.engine.engine.spec.block_size, payloads) if payloads else None

    def _convert(self, request) -> tuple[Request, list]:
        """Raises ValueError on a malformed request or a manifest of another KV spec."""
        params = sampling_params_from_proto(request.sampling_params, default_temperature=0.0)
        # EOS known before resumed outputs are appended: one inside them ends the request there.
        engine_request = Request(request.request_id, list(request.prompt_token_ids), params,
                                 eos_token_id=self.engine.engine.eos_token_id)
        if request.HasField("first_token_id") != request.HasField("manifest"):
            raise ValueError("first_token_id and manifest come together (disaggregated) or not at all (colocated)")
        if request.output_token_ids and request.HasField("manifest"):
            raise ValueError("output_token_ids resume a request: they come without first_token_id and manifest")
        _append_outputs(engine_request, request.output_token_ids)
        if not request.HasField("manifest"):
            return engine_request, []
        spec = self.engine.engine.spec
        manifest = request.manifest
        if manifest.spec_fingerprint != spec.fingerprint:
            raise ValueError(f"manifest KV spec {manifest.spec_fingerprint!r} != this worker's {spec.fingerprint!r}")
        if manifest.num_tokens != len(request.prompt_token_ids):
            raise ValueError(f"manifest covers {manifest.num_tokens} tokens, prompt has {len(request.prompt_token_ids)}")
        keys = [block_key_from_proto(k) for k in manifest.blocks]
        if len(keys) != -(-manifest.num_tokens // spec.block_size):
            raise ValueError(f"manifest lists {len(keys)} blocks for {manifest.num_tokens} tokens")
        return engine_request, keys

    async def GetStats(self, request, context):
        return stats_response(self.engine, num_cached_tokens=0)
