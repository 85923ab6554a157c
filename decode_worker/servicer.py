"""tandem.v1.DecodeWorker: converts protobuf and delegates to the decode flow."""

from __future__ import annotations

import logging

import grpc

from core.proto_convert import (
    block_key_from_proto, finish_reason_to_proto, sampling_params_from_proto, token_logprob_to_proto,
)
from core.request import Request
from engine.async_engine import AsyncEngine
from engine.kv_connector import DecodeStart, KVConnector, KVLoadError, Manifest
from tandem.v1 import decode_worker_pb2, decode_worker_pb2_grpc
from worker.stats import stats_response

log = logging.getLogger(__name__)


def _finished(request: Request) -> decode_worker_pb2.DecodeResponse:
    return decode_worker_pb2.DecodeResponse(
        finished=decode_worker_pb2.Finished(
            finish_reason=finish_reason_to_proto(request.finish_reason), num_output_tokens=request.num_output_tokens
        )
    )


def manifest_from_proto(manifest) -> Manifest:
    return Manifest(manifest.spec_fingerprint, manifest.pool_address,
                    [block_key_from_proto(k) for k in manifest.blocks], manifest.num_tokens, manifest.kv_dtype)


def decode_start_from_proto(request: decode_worker_pb2.DecodeRequest) -> DecodeStart:
    return DecodeStart(
        manifest=manifest_from_proto(request.manifest) if request.HasField("manifest") else None,
        first_token_id=request.first_token_id if request.HasField("first_token_id") else None,
        output_token_ids=tuple(request.output_token_ids),
    )


class DecodeServicer(decode_worker_pb2_grpc.DecodeWorkerServicer):
    """Decode: the KV connector takes the request over and gives the KV it starts from
    (:meth:`KVConnector.load_for_decode`: a manifest's blocks fetched off the step loop, a resumed
    request's stored prefix, or nothing when colocated); the request joins the running batch at
    the next step and every new token is streamed; a handed-over request (with a manifest) is
    told ``started`` first, as the pass that admits it begins. A refused request (malformed, a
    manifest of another KV spec) ends with ``INVALID_ARGUMENT``; a failed KV load under
    ``--kv-load-failure-policy fail`` with ``UNAVAILABLE`` and the reason in trailing metadata.

    DropManifest: the router gave up delivering a manifest here (the client left, or the Decode
    stream was cancelled before this worker answered it); the connector releases it unless a
    Decode took it over first (:meth:`KVConnector.drop_undelivered`)."""

    def __init__(self, engine: AsyncEngine, connector: KVConnector):
        self.engine = engine
        self.connector = connector
        self.num_cached_tokens = 0  # prompt tokens of requests prefilled here that it did not compute

    async def Decode(self, request, context):
        start = decode_start_from_proto(request)
        try:
            engine_request = self._convert(request)
            external = await self.connector.load_for_decode(engine_request, start)
        except ValueError as err:  # nothing taken over: release what the request brought
            await self.connector.refuse(request.request_id, start)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except KVLoadError as err:  # released in the pool already
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(err), err.trailing_metadata)
        if engine_request.is_finished:  # its first token or its outputs so far end it
            yield _finished(engine_request)
            return
        # A cancelled stream parked at `yield` gets no exception in this handler: abort from the
        # RPC's done callback instead (a no-op once the request finished).
        context.add_done_callback(lambda _: self.engine.abort(request.request_id))
        prefills_here = start.manifest is None  # colocated or resumed: this worker computes the prompt
        try:
            # A handed-over request: say when its first pass here begins (the router paces the
            # prefill's first token by it).
            async for output in self.engine.generate(engine_request, external, notify_start=not prefills_here):
                if output.started:
                    yield decode_worker_pb2.DecodeResponse(started=decode_worker_pb2.Started())
                elif output.new_token_ids:
                    logprobs = [token_logprob_to_proto(s.token_id, s.logprob, s.top_logprobs) for s in output.logprobs]
                    prompt = [token_logprob_to_proto(s.token_id, s.logprob, s.top_logprobs)
                              for s in output.prompt_logprobs or ()]
                    tokens = decode_worker_pb2.TokenChunk(token_ids=output.new_token_ids, logprobs=logprobs,
                                                          prompt_logprobs=prompt)
                    if prefills_here:  # its first computed token: say how much of the prompt was cached
                        tokens.num_cached_tokens, prefills_here = output.num_cached_tokens, False
                        self.num_cached_tokens += output.num_cached_tokens
                    yield decode_worker_pb2.DecodeResponse(tokens=tokens)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        yield _finished(engine_request)

    def _convert(self, request) -> Request:
        """Raises ValueError on malformed sampling parameters or prompt."""
        params = sampling_params_from_proto(request.sampling_params)
        # EOS known before resumed outputs are appended: one inside them ends the request there.
        return Request(request.request_id, list(request.prompt_token_ids), params,
                       eos_token_id=self.engine.eos_token_id)

    async def DropManifest(self, request, context):
        released = await self.connector.drop_undelivered(request.request_id, manifest_from_proto(request.manifest))
        return decode_worker_pb2.DropManifestResponse(released=released)

    async def GetStats(self, request, context):
        return stats_response(self.engine, self.connector.kv_load, num_cached_tokens=self.num_cached_tokens)
