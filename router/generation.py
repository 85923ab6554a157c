"""One request through the cluster, shared by both front-ends (docs/design.md §2, steps 2-6).

``generate`` picks a prefill worker, hands the KV manifest and the first token Prefill sampled
to a decode worker and streams the tokens, detokenized and filtered by stop strings. The first
token is held until the decode worker starts the request's first pass there (its ``started``
event), at most ``first_token_hold_s``: the client then gets tokens 1 and 2 one decode pass apart
rather than the handoff plus a pass and a half (0 streams it as soon as Prefill answers).
Whatever happens (finish, stop string, error, client gone) the decode stream is cancelled; a
manifest no decode worker answered for is dropped at the decode worker it was meant for
(``DropManifest``: its KV connector releases it in the pool unless a Decode took it over).

Failures: a worker that breaks an RPC or a stream is marked down in the view at once. A
failed prefill is retried once on another prefill worker (or, when none is left, prefilled by the
decode worker, colocated). A decode stream that breaks mid-answer is resumed on another decode
worker from prompt + the tokens already sent (``DecodeRequest.output_token_ids``), at most
``MAX_MIGRATIONS`` times: the client sees one stream, no token repeated or missing. Every attempt
gets its own worker-facing request id (:func:`attempt_id`), so neither attempts nor clients
reusing an id share worker or pool state; the client's id stays in logs and responses. A worker
that hangs (stops heartbeating) fails its waiting calls the same way (router.workers.loss).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from core.request import FinishReason
from core.registry import WorkerInfo
from router.errors import ErrorKind, KVSaveFailedError, RouterError, WorkerFailedError
from router.placement.fallback import ColocatedFallbacks
from router.output.logprobs import TokenLogprob
from router.metrics import RouterMetrics
from router.output.processor import OutputProcessor, OutputStep
from router.api.request_ids import attempt_id
from router.shutdown import Shutdown
from router.placement.prediction import Placement
from router.placement.placer import Placer
from router.tokenizer import ModelTokenizer
from router.api.validation import ValidatedRequest
from router.workers.clients import DecodeStarted, DecodeTokens, PrefillResult, WorkerClients
from router.workers.loss import stream_unless_lost, unless_lost
from router.workers.view import WorkerView

log = logging.getLogger(__name__)

MAX_PREFILL_ATTEMPTS = 2  # the first try and one retry on another prefill worker
MAX_MIGRATIONS = 2  # decode streams resumed on another worker after theirs failed


@dataclass(frozen=True)
class TextDelta:
    """New text safe to show, and the tokens accepted with it (text may lag its tokens)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids when the request asked for them
    # On the first delta when the request asked for prompt logprobs: prompt tokens 1.. in order.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


def _delta(step: OutputStep, logprobs: tuple[TokenLogprob, ...],
           prompt_logprobs: tuple[TokenLogprob, ...] = ()) -> TextDelta:
    """The step's text and accepted tokens, with the logprobs of those tokens only."""
    return TextDelta(step.text, step.token_ids, logprobs[: len(step.token_ids)], prompt_logprobs)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens not computed for the first token: loaded from the pool (disaggregated) or
    # found in the decode worker's own prefix cache (colocated).
    cached_tokens: int


@dataclass(frozen=True)
class Finished:
    """The last event of a request."""

    finish_reason: FinishReason
    usage: Usage
    ttft_s: float


GenerationEvent = TextDelta | Finished


@dataclass
class _Handoff:
    """A prefill's manifest whose pool state the prefill worker handed over, while no decode
    worker has answered for it."""

    request_id: str  # the prefill attempt's id: the manifest's request in the pool
    prefill: PrefillResult  # its manifest
    decode_address: str  # the decode worker it was sent to last (before any: the placement's)


@dataclass(eq=False)
class _Run:
    """Mutable state of one request while it is generated."""

    request_id: str  # the client's id (or the front-end's): logs and responses only
    request: ValidatedRequest
    arrival_time_s: float  # time.monotonic()
    output: OutputProcessor
    num_cached_tokens: int = 0
    ttft_s: float = 0.0  # until the first token went to the client
    last_token_time_s: float = 0.0
    sent_first_token: bool = False  # the first token exists (a prefill answered, or a decode worker sent it)
    # Worker-facing ids of every attempt (released in the pool at the end); the decode attempt
    # after a successful prefill reuses that prefill's id (its manifest's scoped blocks).
    attempt_ids: list[str] = field(default_factory=list)
    num_migrations: int = 0
    placement: Placement | None = None  # where the router placed it (router.placement.placer)
    undelivered: _Handoff | None = None  # dropped at its decode worker when the request ends


class Generation:
    """Runs requests across the prefill and decode workers the view knows."""

    def __init__(
        self,
        view: WorkerView,
        clients: WorkerClients,
        tokenizer: ModelTokenizer,
        metrics: RouterMetrics,
        placer: Placer,
        timeout_s: float,
        first_token_hold_s: float = 0.0,
    ):
        self.view, self.clients, self.tokenizer = view, clients, tokenizer
        self.metrics, self.placer, self.timeout_s = metrics, placer, timeout_s
        self.first_token_hold_s = first_token_hold_s
        self.shutdown = Shutdown()  # router.server stops through it (router.shutdown)
        self.fallbacks = ColocatedFallbacks(metrics)  # colocated for want of a prefill worker

    async def generate(
        self, request_id: str, request: ValidatedRequest, arrival_time_s: float
    ) -> AsyncIterator[GenerationEvent]:
        """Yields TextDelta events (the first right after prefill), then one Finished.

        ``arrival_time_s`` (time.monotonic()) is when the request reached the router: TTFT,
        E2E latency and the request timeout count from it.

        Raises:
            RouterError: no healthy worker, or a worker failed (before or after the first token);
                SHUTTING_DOWN when the router is stopping (refused at once once ``shutdown``
                began; a running request when ``shutdown.abort()`` ends it).
        """
        try:
            self.shutdown.enter()
        except RouterError as err:
            self.metrics.rejected(err.kind.value)
            raise
        try:
            async with contextlib.aclosing(self._generate(request_id, request, arrival_time_s)) as events:
                while (event := await self.shutdown.guard(anext(events, None))) is not None:
                    yield event
        finally:
            self.shutdown.leave()

    async def _generate(
        self, request_id: str, request: ValidatedRequest, arrival_time_s: float
    ) -> AsyncIterator[GenerationEvent]:
        """``generate`` without the shutdown guard."""
        params = request.sampling_params
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=request.skip_special_tokens)
        output = OutputProcessor(params, request.stop, self.tokenizer.eos_token_ids, decode)
        run = _Run(request_id, request, arrival_time_s, output)
        self.metrics.num_requests_running.inc()
        error: BaseException | None = None
        try:
            # Where it runs (decode worker, prefill worker unless colocated), or 429 (SLO admission).
            run.placement = await self.placer.place(
                run.request_id, request.prompt_token_ids, params.max_tokens,
                self.view.workers("prefill"), self.view.workers("decode"),
            )
            self.fallbacks.placed(len(self.view.workers("prefill")), run.placement.prefill is None)
            prefill, held = None, None
            if run.placement.prefill is not None:  # disaggregated; else colocated on the decode worker
                prefill = await self._prefill(run)
                if prefill is not None:  # None: no prefill worker left after a failure
                    first = self._first_token(run, prefill)
                    # The prefill worker released the request itself when its own stop rule ended
                    # it at the first token; else (a stop string too) it handed the manifest over.
                    if run.output.finish_reason is None or run.output.stopped_by_string:
                        run.undelivered = _Handoff(run.attempt_ids[-1], prefill, run.placement.decode.address)
                    if run.output.finish_reason is None and self.first_token_hold_s > 0:
                        held = first  # released as the decode worker starts (_release_first)
                    else:
                        self._first_token_sent(run)
                        yield first
            if prefill is None or run.output.finish_reason is None:
                async with (contextlib.aclosing(self._decode(run, prefill)) as deltas,
                            contextlib.aclosing(self._release_first(run, held, deltas)) as paced):
                    async for delta in paced:
                        if delta.text or delta.token_ids:
                            yield delta
            yield self._finished(run)
        except BaseException as err:  # cancellation and GeneratorExit included: counted, re-raised
            error = err
            raise
        finally:
            self.metrics.num_requests_running.dec()
            self.placer.finished(run.placement)
            self._record_end(run, error)
            # No pool release here: the workers' KV connectors own every request's pool state
            # (engine/kv_connector/connector.py says who releases on each path). A manifest no
            # decode worker answered for goes back to the one it was meant for, which releases it.
            if run.undelivered is not None:
                handoff = run.undelivered
                self.clients.drop_manifest(handoff.decode_address, handoff.request_id, handoff.prefill)

    def _choose(self, role: str, run: _Run) -> WorkerInfo:
        """The placement's worker of ``role`` while it is live; else (a retry, a migration) the
        policy's choice among the live ones. Raises RouterError(NO_WORKER) when none is live."""
        placement = run.placement
        planned = None if placement is None else placement.prefill if role == "prefill" else placement.decode
        return self.placer.choose(role, self.view.workers(role), run.request_id, run.request.prompt_token_ids, planned)

    def _remaining_s(self, run: _Run) -> float:
        remaining_s = self.timeout_s - (time.monotonic() - run.arrival_time_s)
        if remaining_s <= 0:
            raise RouterError(f"request timed out after {self.timeout_s:g} s", ErrorKind.UNAVAILABLE)
        return remaining_s

    def _new_attempt(self, run: _Run) -> str:
        rid = attempt_id(run.request_id)
        run.attempt_ids.append(rid)
        return rid

    def _worker_failed(self, role: str, err: WorkerFailedError, run: _Run) -> None:
        self.view.mark_down(err.address, f"{role}: {err.message}")
        self.metrics.worker_failed(role)
        log.warning("%s worker %s failed: %s", role, err.address, err.message, extra={"request_id": run.request_id})

    async def _prefill(self, run: _Run) -> PrefillResult | None:
        """Runs Prefill; after a worker failure once more on another prefill worker (the failed
        one is marked down). None when a failure left no prefill worker: the decode worker
        prefills instead (colocated).

        Raises:
            RouterError: the request was refused, timed out, or both attempts failed.
        """
        failure: WorkerFailedError | None = None
        for _ in range(MAX_PREFILL_ATTEMPTS):
            if failure is not None and not self.view.workers("prefill"):
                log.warning("no prefill worker left; prefilling on the decode worker", extra={"request_id": run.request_id})
                self.fallbacks.count("prefill_failed")
                return None
            if failure is not None:
                self.metrics.prefill_retried()
            worker = self._choose("prefill", run)
            rid = self._new_attempt(run)
            try:
                with self.placer.attempt(worker.address):
                    call = self.clients.prefill(worker.address, rid, run.request, self._remaining_s(run))
                    result = await unless_lost(call, self.view.loss.lost_event(worker.address), worker.address)
            except KVSaveFailedError as err:  # the pool broke, not the worker: the decode worker prefills
                log.warning("%s; prefilling on the decode worker", err.message, extra={"request_id": run.request_id})
                self.fallbacks.count("pool_write_failed")
                return None
            except WorkerFailedError as err:
                failure = err
                self._worker_failed("prefill", err, run)
                continue
            run.num_cached_tokens = result.num_cached_tokens
            return result
        raise RouterError(f"{failure.message} (after {MAX_PREFILL_ATTEMPTS} attempts)", ErrorKind.UNAVAILABLE)

    def _first_token(self, run: _Run, prefill: PrefillResult) -> TextDelta:
        """Accepts the prefill's first token (its prefill leaves the placer's queue now); the
        client's TTFT counts when it is sent (:meth:`_first_token_sent`)."""
        run.sent_first_token = True
        self.placer.first_token(run.placement, time.monotonic() - run.arrival_time_s)
        logprobs = () if prefill.first_token_logprob is None else (prefill.first_token_logprob,)
        return _delta(run.output.add_tokens([prefill.first_token_id]), logprobs, prefill.prompt_logprobs)

    def _first_token_sent(self, run: _Run) -> None:
        now_s = time.monotonic()
        run.ttft_s, run.last_token_time_s = now_s - run.arrival_time_s, now_s
        self.metrics.first_token(run.ttft_s, len(run.request.prompt_token_ids), run.num_cached_tokens)

    def _mark_first_token(self, run: _Run, num_cached_tokens: int) -> None:
        """A decode worker's first token (colocated): accepted and sent at once."""
        run.sent_first_token, run.num_cached_tokens = True, num_cached_tokens
        self.placer.first_token(run.placement, time.monotonic() - run.arrival_time_s)
        self._first_token_sent(run)

    async def _release_first(
        self, run: _Run, held: TextDelta | None, deltas: AsyncIterator[TextDelta]
    ) -> AsyncIterator[TextDelta]:
        """``deltas``, after ``held`` (the prefill's first token, when held): that goes out with
        the decode worker's first event (``started``, as the pass computing token 2 begins; or
        its tokens, its end or an error) or after ``first_token_hold_s``, whichever is first."""
        if held is not None:
            pending = asyncio.ensure_future(anext(deltas, None))
            try:
                await asyncio.wait((pending,), timeout=self.first_token_hold_s)
                self._first_token_sent(run)
                yield held
                first = await pending
            finally:  # the client left (or shutdown aborted) while it was held: stop the decode stream
                if not pending.done():
                    pending.cancel()
                    await asyncio.gather(pending, return_exceptions=True)
            if first is None:
                return
            yield first
        async for delta in deltas:
            yield delta

    async def _decode(self, run: _Run, prefill: PrefillResult | None) -> AsyncIterator[TextDelta]:
        """Yields one TextDelta per decode message. When the decode worker breaks before the end,
        it is marked down and the request resumes on another decode worker from prompt + the
        tokens already accepted; only tokens after those reach the client.

        ``prefill`` None is the colocated path: the decode worker prefills and sends every token.

        Raises:
            RouterError: the request was refused or timed out, ``MAX_MIGRATIONS`` resumptions
                failed too, or no decode worker is left.
        """
        while True:
            worker = self._choose("decode", run)
            first_try = run.num_migrations == 0
            rid = run.attempt_ids[-1] if first_try and prefill is not None else self._new_attempt(run)
            try:
                async with contextlib.aclosing(self._decode_on(worker, rid, run, prefill if first_try else None)) as deltas:
                    async for delta in deltas:
                        yield delta
                return
            except WorkerFailedError as err:
                self._worker_failed("decode", err, run)
                if run.output.finish_reason is not None:  # every token arrived; only the end was lost
                    return
                if run.num_migrations >= MAX_MIGRATIONS:
                    raise RouterError(f"{err.message} (after {MAX_MIGRATIONS} migrations)", ErrorKind.UNAVAILABLE) from err
                if not self.view.workers("decode"):
                    raise RouterError(f"{err.message}; no other decode worker to resume on", ErrorKind.UNAVAILABLE) from err
                run.num_migrations += 1
                self.metrics.migrated()
                log.warning("resuming on another decode worker after %d tokens (migration %d)",
                            run.output.num_output_tokens, run.num_migrations, extra={"request_id": run.request_id})

    async def _decode_on(
        self, worker: WorkerInfo, rid: str, run: _Run, prefill: PrefillResult | None
    ) -> AsyncIterator[TextDelta]:
        """One Decode stream on ``worker``; cancels it however it ends. Without ``prefill`` the
        worker resumes from the tokens accepted so far (none: colocated from the prompt)."""
        with self.placer.attempt(worker.address):
            self.placer.decoding(worker.address, run.placement)
            resume = () if prefill is not None else tuple(run.output.token_ids)
            if prefill is not None and run.undelivered is not None:
                run.undelivered.decode_address = worker.address
            stream = self.clients.decode(worker.address, rid, run.request, prefill, self._remaining_s(run), resume)
            try:
                async for event in stream_unless_lost(stream, self.view.loss.lost_event(worker.address), worker.address):
                    if prefill is not None:  # the worker answered: its KV connector holds the manifest
                        run.undelivered = None
                    if isinstance(event, DecodeStarted):
                        yield TextDelta("", ())  # no tokens: releases a held first token
                    elif isinstance(event, DecodeTokens):
                        first = not run.sent_first_token
                        if first:  # colocated: this worker prefilled
                            self._mark_first_token(run, event.num_cached_tokens)
                        step = run.output.add_tokens(event.token_ids)
                        if not first:
                            self._count_tokens(run, len(step.token_ids))
                        # A resumed stream computes the prompt again: its prompt logprobs were sent.
                        yield _delta(step, event.logprobs, event.prompt_logprobs if first else ())
                        if run.output.stopped_by_string:
                            return  # the decode worker knows no stop strings: cancel it
                    else:
                        yield TextDelta(run.output.finish(event.finish_reason), ())
                        return
            finally:
                stream.cancel()

    def _count_tokens(self, run: _Run, num_tokens: int) -> None:
        if num_tokens:
            now_s = time.monotonic()
            self.metrics.output_tokens(num_tokens, now_s - run.last_token_time_s)
            run.last_token_time_s = now_s

    def _finished(self, run: _Run) -> Finished:
        usage = Usage(len(run.request.prompt_token_ids), run.output.num_output_tokens, run.num_cached_tokens)
        return Finished(run.output.finish_reason, usage, run.ttft_s)

    def _record_end(self, run: _Run, error: BaseException | None) -> None:
        """Counts the request once: rejected (a RouterError before the first token) or finished
        (abort when it ended without a finish reason: an error mid-stream, or the client left)."""
        if isinstance(error, RouterError) and not run.sent_first_token:
            self.metrics.rejected(error.kind.value)
            log.info("request rejected: %s", error.message, extra={"request_id": run.request_id})
            return
        reason = run.output.finish_reason or FinishReason.ABORT
        self.metrics.finished(reason.value, time.monotonic() - run.arrival_time_s)
        log.info(
            "request finished: %s, %d prompt + %d output tokens",
            reason.value, len(run.request.prompt_token_ids), run.output.num_output_tokens,
            extra={"request_id": run.request_id},
        )
