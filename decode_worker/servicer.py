"""tandem.v1.DecodeWorker: converts protobuf and delegates to the decode flow."""

from __future__ import annotations

import logging

import grpc

from core.proto_convert import (
    block_key_from_proto, finish_reason_to_proto, sampling_params_from_proto, token_logprob_to_proto,
)
from core.request import Request
from engine.async_engine import AsyncEngine
from engine.kv_connector import KVConnector, KVLoadError, Manifest
from engine.worker_runtime import stats_response
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


def manifest_from_proto(manifest) -> Manifest:
    return Manifest(manifest.spec_fingerprint, manifest.pool_address,
                    [block_key_from_proto(k) for k in manifest.blocks], manifest.num_tokens)


class DecodeServicer(decode_worker_pb2_grpc.DecodeWorkerServicer):
    """Disaggregated decode: the KV connector fetches the manifest's blocks (off the step loop)
    and releases the request in the pool; the request joins the running batch at the next step
    and streams every new token. Colocated (no manifest): prefill here in chunks mixed into the
    decode steps (Sarathi-Serve), then decode; every token is streamed, the first included.
    Resumed (``output_token_ids``, after another decode worker failed): the connector loads the
    longest prefix of prompt + those tokens stored in the pool, the engine recomputes the rest,
    only new tokens are streamed. A failed KV load follows ``--kv-load-failure-policy``: prefill
    the prompt here instead, or end with ``UNAVAILABLE`` and the reason in trailing metadata."""

    def __init__(self, engine: AsyncEngine, connector: KVConnector):
        self.engine = engine
        self.connector = connector

    async def Decode(self, request, context):
        manifest = manifest_from_proto(request.manifest) if request.HasField("manifest") else None
        try:
            engine_request = self._convert(request, manifest)
        except ValueError as err:
            if manifest is not None:  # this worker got the request's pool state: it releases it
                await self.connector.drop_manifest(request.request_id, manifest)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        external = None
        if manifest is not None:  # disaggregated: the prompt's KV is in the pool
            if engine_request.append_output_token(request.first_token_id) is not None:
                await self.connector.drop_manifest(request.request_id, manifest)
                yield _finished(engine_request)  # the first token already ends it
                return
            try:
                external = await self.connector.load_manifest(request.request_id, manifest)
            except KVLoadError as err:  # --kv-load-failure-policy fail (released in the pool already)
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err), err.trailing_metadata)
        elif request.output_token_ids:  # resumed: the tokens so far are outputs, not prompt
            if engine_request.is_finished:
                yield _finished(engine_request)
                return
            try:
                external = await self.connector.load_resumed(request.request_id, engine_request.all_token_ids)
            except KVLoadError as err:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(err), err.trailing_metadata)
            log.info("resuming after %d output tokens: %d of %d tokens loaded from the pool, the rest recomputed",
                     engine_request.num_output_tokens, external.num_tokens if external else 0,
                     engine_request.num_tokens, extra={"request_id": request.request_id})
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

    def _convert(self, request, manifest: Manifest | None) -> Request:
        """Raises ValueError on a malformed request or a manifest of another KV spec."""
        params = sampling_params_from_proto(request.sampling_params)
        # EOS known before resumed outputs are appended: one inside them ends the request there.
        engine_request = Request(request.request_id, list(request.prompt_token_ids), params,
                                 eos_token_id=self.engine.engine.eos_token_id)
        if request.HasField("first_token_id") != (manifest is not None):
            raise ValueError("first_token_id and manifest come together (disaggregated) or not at all (colocated)")
        if request.output_token_ids and manifest is not None:
            raise ValueError("output_token_ids resume a request: they come without first_token_id and manifest")
        _append_outputs(engine_request, request.output_token_ids)
        if manifest is not None:
            manifest.validate(self.engine.engine.spec, len(request.prompt_token_ids))
        return engine_request

    async def GetStats(self, request, context):
        return stats_response(self.engine, self.connector.kv_load, num_cached_tokens=0)
