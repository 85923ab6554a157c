"""AsyncEngine: drives an LLMEngine in its own thread and streams outputs to asyncio callers.

Torch releases the GIL inside kernels, so the step loop runs beside the asyncio event loop that
serves gRPC; requests arrive and abort between steps (iteration-level scheduling, Orca).

The step loop runs on the thread that built the engine (:func:`engine_thread`): OpenMP keeps one
thread pool per thread that opens parallel regions, and once a process holds more pool threads
than cores, libgomp stops spinning at barriers (its "throttled" wait), which made every decode
step ~30% slower here when the model was loaded on the main thread and run on another.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor

from core.kv_cache_spec import KVCacheSpec
from core.request import FinishReason, Request
from core.worker_load import WorkerLoad
from engine.core_share import CoreShare
from engine.engine import LLMEngine
from engine.kv_connector.swap import SwapSpace
from engine.outputs import ExternalKV, RequestOutput

log = logging.getLogger(__name__)


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that builds an engine (model load, calibration) and then runs its step
    loop: pass it to :class:`AsyncEngine`."""
    return ThreadPoolExecutor(1, thread_name_prefix="engine")


class AsyncEngine:
    """Thread-safe front of one LLMEngine. ``start()`` must be called inside the event loop.

    ``thread``: where the step loop runs (default: a new :func:`engine_thread`); give it the
    executor that built ``engine`` so torch runs on one thread throughout. ``cores``: this
    worker's side of core sharing with the other role on the machine (engine.core_share), told
    when the loop has work, after each pass and when it goes idle; closed by :meth:`stop`.
    """

    def __init__(self, engine: LLMEngine, thread: ThreadPoolExecutor | None = None, cores: CoreShare | None = None):
        self.engine = engine
        self.cores = cores
        self._executor = thread or engine_thread()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: Future | None = None
        self._stopping = False
        self._stats = engine.stats()
        engine.structured.on_ready = self._wakeup.set  # a compiled grammar wakes an idle loop
        engine.on_pass_start = self._on_pass_start
        self._start_watch: set[str] = set()  # requests whose callers asked for a started marker
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    @property
    def spec(self) -> KVCacheSpec:
        """The engine's KV cache layout (what a manifest of another worker must match)."""
        return self.engine.spec

    @property
    def eos_token_id(self) -> int | None:
        """The model's end-of-sequence token (None: the model has none)."""
        return self.engine.eos_token_id

    def use_swap_space(self, swap_space: SwapSpace) -> None:
        """Before :meth:`start`: preempted requests swap their KV into ``swap_space`` when the
        engine's preemption mode is ``swap`` (else they recompute and this does nothing)."""
        if self.engine.config.preemption_mode == "swap":
            self.engine.use_swap_space(swap_space)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = self._executor.submit(self._run)

    def stop(self) -> None:
        """Stops the step loop after the current step; unfinished requests are dropped."""
        self._stopping = True
        self._wakeup.set()
        if self._running is not None:
            try:
                self._running.result(timeout=10)
            except TimeoutError:
                log.warning("engine step loop did not stop within 10 s")
        if self.cores is not None:
            self._executor.submit(self.cores.close)  # after the loop: torch's threads belong to that thread
        self._executor.shutdown(wait=False)

    def stats(self) -> WorkerLoad:
        """Snapshot taken after the latest step."""
        return self._stats

    async def generate(self, request: Request, external_kv: ExternalKV | None = None,
                       notify_start: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. With ``notify_start``, first one
        output with ``started`` set and no tokens, as the pass that admits the request begins
        (a decode worker pacing a disaggregated stream's first token by it; docs/routing.md).

        Cancelling the consumer (client gone) aborts the request in the engine, freeing its
        blocks at the next step boundary.

        Raises:
            ValueError: the engine refused the request (message from the engine), or the id is in use.
        """
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        stream: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[rid] = stream
        if notify_start:
            self._start_watch.add(rid)
        self._inbox.put(("add", request, external_kv))
        self._wakeup.set()
        try:
            while True:
                output = await stream.get()
                if output.error is not None:
                    raise ValueError(output.error)
                yield output
                if output.finished:
                    return
        finally:
            self._start_watch.discard(rid)
            if self._streams.pop(rid, None) is not None and not request.is_finished:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        """Aborts at the next step boundary; returns False when no caller awaits the request."""
        known = request_id in self._streams
        self._inbox.put(("abort", request_id, None))
        self._wakeup.set()
        return known

    def _run(self) -> None:
        engine, cores = self.engine, self.cores
        while not self._stopping:
            self._drain_inbox()
            self._stats = engine.stats()  # aborts free blocks without a step
            if not engine.has_unfinished_requests():
                if cores is not None:
                    cores.idle()
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()
                continue
            if cores is not None:
                cores.busy()
            ran = False
            try:
                for outputs in engine.step_stream():
                    ran = True
                    self._deliver_all(outputs)
                    self._drain_inbox()  # joins and aborts take effect at the next pass
                    self._stats = engine.stats()
                    if cores is not None:
                        cores.between_passes()
            except Exception:  # a bug must not strand callers: fail every request in flight
                log.exception("engine step failed")
                self._deliver_all(self._fail_all())
            self._stats = engine.stats()
            if not ran:  # only requests whose grammar is compiling: wait for one (on_ready)
                if cores is not None:
                    cores.idle()  # a borrower must not keep the cores through the wait
                self._wakeup.wait(timeout=1.0)
                self._wakeup.clear()

    def _deliver_all(self, outputs: list[RequestOutput]) -> None:
        """Hands a pass's outputs to the event loop in one wake-up: each ``call_soon_threadsafe``
        writes the loop's self-pipe and wakes its thread, which on a machine whose cores all run
        the forward pass's OpenMP team takes a core from it (16 wake-ups per pass at batch 16 were
        3 % of the engine thread's time)."""
        if not outputs:
            return
        for output in outputs:
            self.num_generated_tokens += len(output.new_token_ids)
        self._send(outputs)

    def _on_pass_start(self, request_ids: list[str]) -> None:
        """Engine thread, just before a forward: a started marker to each caller among
        ``request_ids`` that asked for one, in one wake-up (none when nobody asked)."""
        watched = [rid for rid in request_ids if rid in self._start_watch]
        if watched:
            self._start_watch.difference_update(watched)
            self._send([RequestOutput(rid, [], started=True) for rid in watched])

    def _drain_inbox(self) -> None:
        while True:
            try:
                op, item, external_kv = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "abort":
                if self.engine.abort_request(item):
                    self._deliver(RequestOutput(item, [], True, FinishReason.ABORT))
                continue
            try:
                self.engine.add_request(item, external_kv)
                self.num_prompt_tokens += item.num_prompt_tokens
            except ValueError as err:
                if external_kv is not None:  # refused: its pool views go now, not at a collection
                    external_kv.let_go()
                self._deliver(RequestOutput(item.request_id, [], True, FinishReason.ABORT, error=str(err)))

    def _fail_all(self) -> list[RequestOutput]:
        failed = []
        for rid in self.engine.request_ids():
            self.engine.abort_request(rid)
            failed.append(RequestOutput(rid, [], True, FinishReason.ABORT, error="engine step failed"))
        return failed

    def _deliver(self, output: RequestOutput) -> None:
        self._send([output])

    def _send(self, outputs: list[RequestOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._put_all, outputs)

    def _put_all(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._put(output)

    def _put(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put_nowait(output)
            if output.finished:  # the consumer keeps its queue; forget it even if never closed
                del self._streams[output.request_id]
