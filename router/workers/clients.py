"""Calls to the prefill and decode workers and to the KV pool, in domain types.

The only router module that sees worker protobufs: it converts requests, turns responses into
plain dataclasses and worker gRPC errors into :class:`RouterError`. Cancelling the awaiting task
(or :meth:`DecodeStream.cancel`) cancels the RPC, and the workers abort on cancellation.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.failure_metadata import KV_LOAD_FAILURE_KEY, KV_SAVE_FAILURE_KEY
from core.grpc_service import CHANNEL_OPTIONS, cluster_aio_channel
from core.proto_convert import finish_reason_from_proto, sampling_params_to_proto, token_logprob_from_proto
from core.request import FinishReason
from router.errors import ErrorKind, KVSaveFailedError, RouterError, WorkerFailedError, kind_from_grpc
from router.output.logprobs import TokenLogprob
from router.api.validation import ValidatedRequest
from router.workers.view import Health
from tandem.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)

log = logging.getLogger(__name__)

# Each channel its own subchannel: from gRPC's global pool a new channel would inherit the old
# one's connection, reconnect backoff included (WorkerClients._channel).
_CHANNEL_OPTIONS = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
HEALTH_TIMEOUT_S = 1.0
# A hung decode worker answers DropManifest when it wakes; past the workers' pool lease deadline
# (60 s by default) the pool has released the manifest by itself anyway.
DROP_MANIFEST_TIMEOUT_S = 60.0
DROP_RETRY_S = 1.0  # between DropManifest tries while the worker cannot be reached
# Statuses that say the worker (or the way to it) broke, not the request: the worker is marked
# down and the request goes to another one. INVALID_ARGUMENT, RESOURCE_EXHAUSTED and
# DEADLINE_EXCEEDED (the request's own time is up) are the request's and are not retried.
WORKER_FAILURE_CODES = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.CANCELLED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.ABORTED,
})


@dataclass(frozen=True)
class PrefillResult:
    first_token_id: int
    num_cached_tokens: int
    pool_address: str
    manifest: common_pb2.KVManifest  # handed to the decode worker untouched
    first_token_logprob: TokenLogprob | None = None  # set when the request asked for logprobs
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., when asked for


@dataclass(frozen=True)
class DecodeTokens:
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids, or empty
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # prompt tokens 1.., with a colocated first token
    # With the first token a worker computed for a request it prefilled (colocated, resumed): the
    # prompt tokens it did not compute (its prefix cache, a pool load); else 0.
    num_cached_tokens: int = 0


def logprobs_from_proto(messages) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(*token_logprob_from_proto(m)) for m in messages)


@dataclass(frozen=True)
class DecodeStarted:
    """A handed-over request's first pass on the decode worker has begun (before its tokens)."""


@dataclass(frozen=True)
class DecodeFinished:
    finish_reason: FinishReason
    num_output_tokens: int  # the first token included


def _router_error(role: str, address: str, err: grpc.aio.AioRpcError, timeout_s: float,
                  request_id: str | None = None) -> RouterError:
    trailing = dict(err.trailing_metadata() or ())
    if KV_SAVE_FAILURE_KEY in trailing:
        return KVSaveFailedError(f"{role} worker could not write the KV cache to the pool: {err.details()}", address)
    reason = trailing.get(KV_LOAD_FAILURE_KEY)
    if reason is not None:
        return RouterError(f"{role} worker could not load the KV cache ({reason}): {err.details()}",
                           ErrorKind.KV_LOAD_FAILED)
    if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"the {role} worker did not answer within the request timeout of {timeout_s:g} s"
    elif err.code() == grpc.StatusCode.INVALID_ARGUMENT:
        # The request's own fault (a grammar the library cannot compile): the client gets the
        # worker's message alone; which worker said it is for the router's log.
        log.info("%s worker %s refused the request (INVALID_ARGUMENT): %s", role, address, err.details(),
                 extra={"request_id": request_id} if request_id else None)
        message = err.details()
    else:
        message = f"{role} worker failed ({err.code().name}): {err.details()}"
    if err.code() in WORKER_FAILURE_CODES:
        return WorkerFailedError(message, address)
    return RouterError(message, kind_from_grpc(err.code()))


class DecodeStream:
    """One Decode server stream: iterate for (with a manifest) one DecodeStarted, DecodeTokens,
    then one DecodeFinished."""

    def __init__(self, call: grpc.aio.UnaryStreamCall, timeout_s: float, address: str = "",
                 request_id: str | None = None):
        self._call = call
        self._timeout_s = timeout_s
        self._address = address
        self._request_id = request_id

    async def __aiter__(self) -> AsyncIterator[DecodeStarted | DecodeTokens | DecodeFinished]:
        """Raises RouterError on a request error; WorkerFailedError when the worker broke or the
        stream ended without ``finished``."""
        try:
            async for response in self._call:
                if response.WhichOneof("event") == "tokens":
                    tokens = response.tokens
                    yield DecodeTokens(tuple(tokens.token_ids), logprobs_from_proto(tokens.logprobs),
                                       logprobs_from_proto(tokens.prompt_logprobs), tokens.num_cached_tokens)
                elif response.WhichOneof("event") == "started":
                    yield DecodeStarted()
                elif response.WhichOneof("event") == "finished":
                    done = response.finished
                    yield DecodeFinished(finish_reason_from_proto(done.finish_reason), done.num_output_tokens)
                    return
        except grpc.aio.AioRpcError as err:
            raise _router_error("decode", self._address, err, self._timeout_s, self._request_id) from err
        raise WorkerFailedError("decode worker ended the stream without finishing", self._address)

    def cancel(self) -> None:
        """Cancels the RPC (a no-op once it has ended); the decode worker aborts the request."""
        self._call.cancel()


class WorkerClients:
    """One channel per worker address, opened on first use and closed by :meth:`close`.

    Args:
        replaced_channel_grace_s: how long a replaced channel (TRANSIENT_FAILURE: nothing new
            connects) keeps the calls still running on it before they are cancelled. The router
            passes its ``request_timeout_s``: every call's deadline falls within that of its
            request's arrival, so each ends by itself first (a draining worker's streams finish).
    """

    def __init__(self, replaced_channel_grace_s: float) -> None:
        self._replaced_channel_grace_s = replaced_channel_grace_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._closing: dict[asyncio.Task, grpc.aio.Channel] = {}  # replaced channels being closed
        self._dropping: set[asyncio.Task] = set()  # DropManifest calls in flight

    def _channel(self, address: str) -> grpc.aio.Channel:
        """The channel to ``address``; a new one when the cached one is in TRANSIENT_FAILURE.
        Such a channel fails every call at once until its reconnect backoff (growing to 120 s)
        ends, even when a worker is back at that address (``tandem up`` restarts a dead worker
        on its port): a fresh channel connects now, or fails as fast if nothing listens."""
        channel = self._channels.get(address)
        if channel is not None and channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            # New calls fail on it, but streams may still run on its open connection: a draining
            # worker (SIGTERM, a rolling update) refuses new connections while it finishes them.
            # They end on the old channel; closing it at once would cancel them mid-stream.
            task = asyncio.create_task(channel.close(grace=self._replaced_channel_grace_s))
            self._closing[task] = channel
            task.add_done_callback(lambda done: self._closing.pop(done, None))
            channel = None
        if channel is None:
            channel = self._channels[address] = cluster_aio_channel(address, options=_CHANNEL_OPTIONS)
        return channel

    async def prefill(self, address: str, request_id: str, request: ValidatedRequest, timeout_s: float) -> PrefillResult:
        """Runs Prefill on the worker at ``address``.

        Raises:
            WorkerFailedError: the worker broke (see WORKER_FAILURE_CODES).
            RouterError: the worker refused the request; its kind follows the gRPC status.
        """
        stub = prefill_worker_pb2_grpc.PrefillWorkerStub(self._channel(address))
        message = prefill_worker_pb2.PrefillRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_proto(request.sampling_params),
        )
        call = stub.Prefill(message, timeout=timeout_s)
        try:
            response = await call
        except grpc.aio.AioRpcError as err:
            raise _router_error("prefill", address, err, timeout_s, request_id) from err
        finally:
            call.cancel()  # no-op when done; cancels the RPC when this task was cancelled
        first_logprob = None
        if response.HasField("first_token_logprob"):
            (first_logprob,) = logprobs_from_proto([response.first_token_logprob])
        return PrefillResult(
            response.first_token_id, response.num_cached_tokens, response.manifest.pool_address, response.manifest,
            first_logprob, logprobs_from_proto(response.prompt_logprobs),
        )

    def decode(
        self, address: str, request_id: str, request: ValidatedRequest, prefill: PrefillResult | None, timeout_s: float,
        output_token_ids: Sequence[int] = (),
    ) -> DecodeStream:
        """Starts Decode on the worker at ``address``; the caller must iterate or cancel it.

        Without ``prefill`` the worker runs colocated: it prefills the prompt itself. With
        ``output_token_ids`` (and no ``prefill``) it resumes a request whose tokens so far are
        those: it streams only the tokens after them.
        """
        stub = decode_worker_pb2_grpc.DecodeWorkerStub(self._channel(address))
        message = decode_worker_pb2.DecodeRequest(
            request_id=request_id,
            prompt_token_ids=request.prompt_token_ids,
            sampling_params=sampling_params_to_proto(request.sampling_params),
        )
        if prefill is not None:
            message.first_token_id = prefill.first_token_id
            message.manifest.CopyFrom(prefill.manifest)
        elif output_token_ids:
            message.output_token_ids.extend(output_token_ids)
        return DecodeStream(stub.Decode(message, timeout=timeout_s), timeout_s, address, request_id)

    def drop_manifest(self, address: str, request_id: str, prefill: PrefillResult) -> None:
        """Tells the decode worker at ``address`` to release ``prefill``'s manifest (the
        request ``request_id`` in the pool) unless a Decode took it over there
        (decode_worker.servicer). In the background, tried again every DROP_RETRY_S while the
        worker cannot be reached, for DROP_MANIFEST_TIMEOUT_S: a hung worker answers when it
        wakes, a partitioned one once the link heals; the pool's lease deadline covers one that
        never does."""
        message = decode_worker_pb2.DropManifestRequest(request_id=request_id, manifest=prefill.manifest)
        task = asyncio.ensure_future(self._drop(address, message))
        self._dropping.add(task)
        task.add_done_callback(self._dropping.discard)

    async def _drop(self, address: str, message: decode_worker_pb2.DropManifestRequest) -> None:
        deadline_s = time.monotonic() + DROP_MANIFEST_TIMEOUT_S
        while (remaining_s := deadline_s - time.monotonic()) > 0:
            stub = decode_worker_pb2_grpc.DecodeWorkerStub(self._channel(address))
            try:
                reply = await stub.DropManifest(message, timeout=remaining_s)
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    log.info("DropManifest failed (%s): the pool's lease deadline releases it", err.code(),
                             extra={"request_id": message.request_id})
                    return
                await asyncio.sleep(DROP_RETRY_S)  # a retry delay, not synchronisation
                continue
            log.debug("manifest dropped: released=%s", reply.released, extra={"request_id": message.request_id})
            return
        log.info("DropManifest unanswered for %g s: the pool's lease deadline releases it", DROP_MANIFEST_TIMEOUT_S,
                 extra={"request_id": message.request_id})

    async def health(self, address: str) -> Health:
        """The worker's grpc.health.v1 answer: SERVING, NOT_SERVING (said so, or nothing listens
        at ``address``), UNKNOWN (no answer within HEALTH_TIMEOUT_S, or another error)."""
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT_S)
        except grpc.aio.AioRpcError as err:
            return Health.NOT_SERVING if err.code() == grpc.StatusCode.UNAVAILABLE else Health.UNKNOWN
        return Health.SERVING if reply.status == health_pb2.HealthCheckResponse.SERVING else Health.NOT_SERVING

    async def close(self) -> None:
        for task in self._dropping:  # the pool's lease deadline releases what they were dropping
            task.cancel()
        for channel in [*self._channels.values(), *self._closing.values()]:
            await channel.close()  # cancels what still runs on them: the router is stopping
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
