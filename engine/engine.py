"""LLMEngine: the step loop of one worker, as a list of named phases."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from core.kv_cache_spec import KVCacheSpec
from core.model_source import ModelSource, resolve_model
from core.request import Request
from core.worker_load import WorkerLoad
from engine.attention_selector import make_attention_backend
from engine.config import EngineConfig
from engine.kv_cache.kv_quant import allocate_kv_cache, cache_dtype
from engine.kv_connector.swap import HostSwapSpace, SwapSpace
from engine.model.compile import compile_layers, warm_up
from engine.model.gguf_convert import ensure_hf_dir
from engine.model.linear_chooser import LinearSetup
from engine.model.loader import TORCH_DTYPES, load_model
from engine.model_runner import ModelRunner
from engine.outputs import ExternalKV, ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.preemption import PreemptionPolicy
from engine.step_stats import StepStats
from engine.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from engine.parallel.build import TensorParallel

log = logging.getLogger(__name__)


class LLMEngine:
    """Runs requests to completion on one model and one paged KV cache.

    ``save_kv_on_finish``: a finished request's prompt blocks are packed into
    ``RequestOutput.saved_kv`` before they are freed (what a prefill worker ships to the pool).
    Not thread-safe: one thread drives it (:class:`engine.async_engine.AsyncEngine` runs it on its
    :func:`~engine.async_engine.engine_thread`).
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, source: ModelSource, save_kv_on_finish=False,
                 swap_space: SwapSpace | None = None, parallel: TensorParallel | None = None):
        """``parallel``: rank 0's handle when ``model`` is one shard of a tensor-parallel worker
        (``from_config`` starts the ranks); the KV cache then holds this rank's KV heads."""
        self.config = config
        self.parallel = parallel
        self.source = source
        self.save_kv_on_finish = save_kv_on_finish
        mc = model.config
        head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
        self.spec = KVCacheSpec(
            model_id=source.name,
            revision=source.revision,
            dtype=config.dtype,
            num_layers=mc.num_hidden_layers,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=head_dim,
            block_size=config.block_size,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        eos = getattr(mc, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        num_kv_heads = mc.num_key_value_heads if parallel is None else len(parallel.layout.kv_heads())
        kv_cache = allocate_kv_cache(mc.num_hidden_layers, config.num_kv_blocks, config.block_size, num_kv_heads,
                                     head_dim, cache_dtype(config.kv_cache_dtype, TORCH_DTYPES[config.dtype]),
                                     config.device)
        if swap_space is None and config.preemption_mode == "swap":
            swap_space = HostSwapSpace(config.swap_space_bytes)
        self.swap_space = swap_space
        self.scheduler = Scheduler(config, PreemptionPolicy(config.preemption_mode if swap_space else "recompute"))
        self.num_swapped_out = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="forward") if config.enable_overlap else None
        backend, sampler = make_attention_backend(config), Sampler(config.seed)
        self.runner = (ModelRunner(model, kv_cache, backend, sampler) if parallel is None
                       else parallel.runner(model, kv_cache, backend, sampler))
        self.structured = StructuredOutputManager(lambda: ensure_hf_dir(source), mc.vocab_size)
        self.runner.structured = self.structured
        # Requests refused after add_request returned (a grammar that does not compile), reported
        # with the next pass's outputs.
        self._refused: list[RequestOutput] = []
        self.step_stats = StepStats()
        self._pass_started_s = 0.0  # perf_counter() at the end of the last forward (see _record)
        # Called on the engine thread with the ids of the requests a pass admits, just before
        # its forward starts (AsyncEngine tells the callers that asked; must not block).
        self.on_pass_start: Callable[[list[str]], None] | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, save_kv_on_finish: bool = False,
                    swap_space: SwapSpace | None = None) -> LLMEngine:
        """Resolves and loads the model (converting a GGUF once), then builds the engine."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model)
        parallel = None
        if config.tensor_parallel_size > 1:
            from engine.parallel.build import start_tensor_parallel  # torch.distributed: only when asked

            model, parallel = start_tensor_parallel(config, source)
        else:
            model = load_model(ensure_hf_dir(source), config.dtype, config.device, config.max_model_len,
                               LinearSetup.from_config(config), quantization=config.quantization)
        engine = cls(config, model, source, save_kv_on_finish, swap_space, parallel)
        if config.compiled:
            compile_layers(model)
            warm_up(engine.runner.warm_up, (1, 2) if config.block_size >= 2 else (1,))
        return engine

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks (nothing at TP=1). Idempotent; the engine is unusable after."""
        self.runner.shutdown()
        self.structured.shutdown()

    def add_request(self, request: Request, external_kv: ExternalKV | None = None) -> None:
        """Queues a request.

        Raises:
            ValueError: a token id outside the vocabulary, or the request cannot fit
                ``max_model_len`` (see Scheduler.add_request).
        """
        vocab_size = self.runner.model.config.vocab_size
        bad = [t for t in request.all_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
        if request.eos_token_id is None:
            request.eos_token_id = self.eos_token_id
        if request.sampling_params.structured_outputs is not None:
            self.structured.add(request, external_kv)  # joins the scheduler once its grammar is compiled
        else:
            self.scheduler.add_request(request, external_kv)

    def abort_request(self, request_id: str) -> bool:
        if self.structured.discard(request_id):  # still waiting for its grammar
            return True
        aborted = self.scheduler.abort(request_id) is not None
        if aborted and self.swap_space is not None:
            self.swap_space.discard(request_id)
        return aborted

    def request_ids(self) -> list[str]:
        """Every request the engine holds (not yet finished and freed, nor aborted)."""
        return self.scheduler.request_ids() + self.structured.waiting_ids()

    def use_swap_space(self, swap_space: SwapSpace) -> None:
        """Swap preempted requests into ``swap_space`` from now on (the decode worker's pool
        swap, built once the KV connector exists). Call before the first request."""
        self.swap_space = swap_space

    def has_unfinished_requests(self) -> bool:
        """True while the engine holds a request (scheduled, or waiting for its grammar) or a
        refusal to report. A pass may still find nothing to run while grammars compile
        (``structured.on_ready`` says when one is ready)."""
        return self.scheduler.num_unfinished > 0 or self.structured.num_waiting > 0 or bool(self._refused)

    def step(self) -> list[RequestOutput]:
        """Runs passes until none can be scheduled; returns every output they produced."""
        return [output for outputs in self.step_stream() for output in outputs]

    def step_stream(self) -> Iterator[list[RequestOutput]]:
        """Runs steps while there is work, yielding each forward pass's outputs as soon as they
        exist; the caller may add or abort requests between yields.

        One scheduling decision covers ``num_scheduler_steps`` passes (vLLM multi-step); a
        request that finishes inside the decision sits the remaining passes out. With
        ``enable_overlap`` the next pass is scheduled and prepared while the current one runs
        (SGLang's overlap scheduler). Returns when a pass would be empty.
        """
        self._pass_started_s = time.perf_counter()  # the first pass's time starts with its scheduling
        self._admit_compiled()
        if self._refused:
            yield self._finish([])
        if self.config.enable_overlap:
            yield from self._overlapped_steps()
            return
        out, substep = self._schedule(), 0
        while not out.is_empty:
            self._swap_out(out)
            self._announce(out)
            runner_output = self._record(self.runner.execute(out))
            yield self._finish(self.scheduler.update_from_output(out, runner_output))
            out, substep = self._next_step(out, substep)

    def _next_step(self, out: SchedulerOutput, substep: int) -> tuple[SchedulerOutput, int]:
        """The pass after ``out``: the decision's next decode pass, or a new decision."""
        if substep + 1 < self.config.num_scheduler_steps:
            following = self.scheduler.continue_decode(out)
            if not following.is_empty:
                return following, substep + 1
        return self._schedule(), 0

    def _schedule(self) -> SchedulerOutput:
        """Admits requests whose grammar is compiled, swaps in, then makes a new scheduling
        decision (which itself never waits on I/O)."""
        self._admit_compiled()
        self._swap_in()
        return self.scheduler.schedule()

    def _admit_compiled(self) -> None:
        """Moves requests whose grammar is ready into the scheduler; refusals wait in _refused."""
        if self.structured.num_waiting:
            self._refused += self.structured.admit_ready(self.scheduler.add_request)

    def _swap_in(self) -> None:
        """Brings swapped-out KV back for the requests the next decision may admit; a swap-in
        that fails leaves the request to recompute. Blocking on a pool swap space."""
        if self.swap_space is None:
            return
        for request_id in self.scheduler.swap_in_candidates():
            self.scheduler.resume_swapped(request_id, self.swap_space.take(request_id))

    def _overlapped_steps(self) -> Iterator[list[RequestOutput]]:
        """Pipeline: launch k → commit k's computed tokens → schedule and prepare k+1 → wait for k
        → resolve k's tokens → patch them into k+1 → launch k+1 → yield k's outputs."""
        out, substep = self._schedule(), 0
        if out.is_empty:
            return
        self._announce(out)
        running = self._executor.submit(self.runner.run, self.runner.prepare(out))
        while True:
            self.scheduler.commit_scheduled(out)
            following, substep = self._next_step(out, substep)
            prepared = self.runner.prepare(following)
            runner_output = self._record(running.result())
            self._swap_out(following)  # step k no longer writes the victims' blocks
            outputs = self._finish(self.scheduler.resolve_sampled(out, runner_output))
            finished = {o.request_id for o in outputs if o.finished}
            if finished and self._drop_finished(following, finished):
                prepared = self.runner.prepare(following)  # rare: a stop token ended a request
            prepared.patch({rid: t.token_id for rid, t in runner_output.sampled.items()})
            if following.is_empty:
                yield outputs
                return
            self._announce(following)
            running = self._executor.submit(self.runner.run, prepared)
            yield outputs
            out = following

    def _announce(self, out: SchedulerOutput) -> None:
        """Tells ``on_pass_start`` which requests the pass about to run admits."""
        if out.admitted_request_ids and self.on_pass_start is not None:
            self.on_pass_start(out.admitted_request_ids)

    def _record(self, runner_output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Feeds the pass's timing to the cost model (engine thread only), called as its forward
        ends. The sample's duration becomes the whole pass: from the previous forward's end (or
        the start of this stream of steps) to this one's, so the fit holds everything between two
        forwards (the previous pass's output processing and delivery, this one's scheduling and
        input preparation), which is what a step costs in the step loop's timeline."""
        sample, now_s = runner_output.step_sample, time.perf_counter()
        if sample is not None:
            forward_s = sample.duration_s
            sample = dataclasses.replace(sample, duration_s=max(forward_s, now_s - self._pass_started_s),
                                         forward_s=forward_s)
            runner_output.step_sample = sample
            self.step_stats.record(sample)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("pass: %d tokens, %d seqs, %.3f k attention pairs, forward %.3f ms, pass %.3f ms",
                          sample.num_new_tokens, sample.num_seqs, sample.attn_pairs, forward_s * 1e3,
                          sample.duration_s * 1e3)
        self._pass_started_s = now_s
        return runner_output

    def _swap_out(self, out: SchedulerOutput) -> None:
        """Packs preempted requests' KV into the swap space before their blocks are reused."""
        for swap in out.swap_outs:
            kv = ExternalKV(swap.num_tokens, self.runner.pack_blocks(swap.block_ids))
            if self.swap_space.put(swap.request_id, kv):
                self.num_swapped_out += 1
            else:
                self.scheduler.resume_swapped(swap.request_id, None)  # recomputed instead
        out.swap_outs.clear()

    @staticmethod
    def _drop_finished(out: SchedulerOutput, finished: set[str]) -> bool:
        """Removes ``finished`` requests from a prepared-ahead step; True if any was removed."""
        kept = [item for item in out.scheduled if item.request_id not in finished]
        dropped = len(kept) != len(out.scheduled)
        out.scheduled[:] = kept
        return dropped

    def _finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            if output.finished:
                self._release(output)
        if self._refused:
            outputs, self._refused = outputs + self._refused, []
        return outputs

    def _release(self, output: RequestOutput) -> None:
        if self.save_kv_on_finish:
            request = self.scheduler.get_request(output.request_id)
            num_prompt_blocks = -(-request.num_prompt_tokens // self.config.block_size)
            block_ids = self.scheduler.block_ids(output.request_id)[:num_prompt_blocks]
            output.saved_kv = self.runner.pack_blocks(block_ids)
        self.scheduler.free(output.request_id)
        self.structured.discard(output.request_id)
        if self.swap_space is not None:
            self.swap_space.discard(output.request_id)

    def stats(self) -> WorkerLoad:
        """A snapshot of the load; refits the cost model when due (engine thread only). The
        KV-load bandwidth is the worker's to fill in (worker.stats.worker_load)."""
        sched = self.scheduler
        last = self.step_stats.last
        num_used_blocks, num_free_blocks = sched.block_usage()
        return WorkerLoad(
            num_requests_running=sched.num_running,
            num_requests_waiting=sched.num_waiting,
            num_total_blocks=self.config.num_kv_blocks,
            num_used_blocks=num_used_blocks,
            num_free_blocks=num_free_blocks,
            num_preemptions=sched.num_preemptions,
            num_batched_tokens=last.num_new_tokens if last is not None and sched.num_unfinished else 0,
            num_waiting_tokens=sched.num_waiting_tokens,
            num_kv_tokens=sched.num_kv_tokens,
            recent_step_time_s=self.step_stats.recent_step_time_s,
            max_num_seqs=self.config.max_num_seqs,
            cost_model=self.step_stats.model(
                # The chunk a prompt gets beside running decodes (the router predicts local
                # prefills on a decode worker with it): max_mixed_prefill_tokens when set.
                max_num_batched_tokens=min(self.config.max_num_batched_tokens,
                                           self.config.max_mixed_prefill_tokens or self.config.max_num_batched_tokens),
                kv_bytes_per_token=self.spec.block_bytes / self.spec.block_size,
            ),
        )
