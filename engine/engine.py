"""LLMEngine: the step loop of one worker, as a list of named phases."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from core.kv_cache_spec import KVCacheSpec
from core.model_source import ModelSource, resolve_model
from core.request import Request
from core.worker_load import WorkerLoad
from engine.attention import AttentionBackend, TorchAttentionBackend
from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.kv_connector import pack_blocks
from engine.loader import ensure_hf_dir
from engine.model.compile import compile_layers, warm_up
from engine.model.loader import TORCH_DTYPES, load_model
from engine.model_runner import ModelRunner
from engine.outputs import ExternalKV, ModelRunnerOutput, RequestOutput, SchedulerOutput
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.step_stats import StepStats
from engine.swap_space import HostSwapSpace, SwapSpace

log = logging.getLogger(__name__)


def make_attention_backend(config: EngineConfig) -> AttentionBackend:
    """``auto`` picks Triton on a CUDA device and the CPU backend elsewhere."""
    name = config.attention_backend
    if name == "auto":
        name = "triton" if config.device.startswith("cuda") else "cpu"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu":
        return CpuAttentionBackend()
    if name == "triton":
        from engine.triton_attention import TritonAttentionBackend  # imports triton: only when chosen

        return TritonAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available in this build")


class LLMEngine:
    """Runs requests to completion on one model and one paged KV cache.

    ``save_kv_on_finish``: a finished request's prompt blocks are packed into
    ``RequestOutput.saved_kv`` before they are freed (what a prefill worker ships to the pool).
    Not thread-safe: one thread drives it (see :class:`engine.engine_thread.EngineThread`).
    """

    def __init__(self, config: EngineConfig, model: torch.nn.Module, source: ModelSource, save_kv_on_finish=False,
                 swap_space: SwapSpace | None = None):
        self.config = config
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
        )
        eos = getattr(mc, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, list) else eos
        kv_cache = torch.zeros(
            (mc.num_hidden_layers, 2, config.num_kv_blocks, config.block_size, mc.num_key_value_heads, head_dim),
            dtype=TORCH_DTYPES[config.dtype],
            device=config.device,
        )
        if swap_space is None and config.preemption_mode == "swap":
            swap_space = HostSwapSpace(config.swap_space_bytes)
        self.scheduler = Scheduler(config, swap_space)
        self.num_swapped_out = 0
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="forward") if config.enable_overlap else None
        self.runner = ModelRunner(model, kv_cache, make_attention_backend(config), Sampler(config.seed))
        self.step_stats = StepStats()

    @classmethod
    def from_config(cls, config: EngineConfig, save_kv_on_finish: bool = False,
                    swap_space: SwapSpace | None = None) -> LLMEngine:
        """Resolves and loads the model (converting a GGUF once), then builds the engine."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        source = resolve_model(config.model)
        model = load_model(ensure_hf_dir(source), config.dtype, config.device, config.max_model_len)
        engine = cls(config, model, source, save_kv_on_finish, swap_space)
        if config.compiled:
            compile_layers(model)
            warm_up(engine.runner.warm_up, (1, 2) if config.block_size >= 2 else (1,))
        return engine

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
        self.scheduler.add_request(request, external_kv)

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

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
        if self.config.enable_overlap:
            yield from self._overlapped_steps()
            return
        out, substep = self.scheduler.schedule(), 0
        while not out.is_empty:
            self._swap_out(out)
            runner_output = self._record(self.runner.execute(out))
            yield self._finish(self.scheduler.update_from_output(out, runner_output))
            out, substep = self._next_step(out, substep)

    def _next_step(self, out: SchedulerOutput, substep: int) -> tuple[SchedulerOutput, int]:
        """The pass after ``out``: the decision's next decode pass, or a new decision."""
        if substep + 1 < self.config.num_scheduler_steps:
            following = self.scheduler.continue_decode(out)
            if not following.is_empty:
                return following, substep + 1
        return self.scheduler.schedule(), 0

    def _overlapped_steps(self) -> Iterator[list[RequestOutput]]:
        """Pipeline: launch k → commit k's computed tokens → schedule and prepare k+1 → wait for k
        → resolve k's tokens → patch them into k+1 → launch k+1 → yield k's outputs."""
        out, substep = self.scheduler.schedule(), 0
        if out.is_empty:
            return
        running = self._executor.submit(self.runner.run, self.runner.prepare(out))
        while True:
            self.scheduler.commit_scheduled(out)
            following, substep = self._next_step(out, substep)
            prepared = self.runner.prepare(following)
            runner_output = self._record(running.result())
            self._swap_out(following)  # step k no longer writes the victims' blocks
            outputs = self._finish(self.scheduler.resolve_sampled(out, runner_output))
            if any(o.finished for o in outputs) and self._drop_finished(following):
                prepared = self.runner.prepare(following)  # rare: a stop token ended a request
            prepared.patch({rid: t.token_id for rid, t in runner_output.sampled.items()})
            if following.is_empty:
                yield outputs
                return
            running = self._executor.submit(self.runner.run, prepared)
            yield outputs
            out = following

    def _record(self, runner_output: ModelRunnerOutput) -> ModelRunnerOutput:
        """Feeds the pass's timing to the cost model (engine thread only)."""
        if runner_output.step_sample is not None:
            self.step_stats.record(runner_output.step_sample)
        return runner_output

    def _swap_out(self, out: SchedulerOutput) -> None:
        """Packs preempted requests' KV into the swap space before their blocks are reused."""
        for swap in out.swap_outs:
            kv = ExternalKV(swap.num_tokens, pack_blocks(self.runner.kv_cache, swap.block_ids))
            if self.scheduler.swap_space.put(swap.request_id, kv):
                self.num_swapped_out += 1
        out.swap_outs.clear()

    @staticmethod
    def _drop_finished(out: SchedulerOutput) -> bool:
        """Removes finished requests from a prepared-ahead step; True if any was removed."""
        kept = [item for item in out.scheduled if not item.request.is_finished]
        dropped = len(kept) != len(out.scheduled)
        out.scheduled[:] = kept
        return dropped

    def _finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for output in outputs:
            if output.finished:
                self._release(output)
        return outputs

    def _release(self, output: RequestOutput) -> None:
        if self.save_kv_on_finish:
            request = self.scheduler.requests[output.request_id]
            num_prompt_blocks = -(-request.num_prompt_tokens // self.config.block_size)
            block_ids = self.scheduler.kv.get(output.request_id).block_ids[:num_prompt_blocks]
            output.saved_kv = pack_blocks(self.runner.kv_cache, block_ids)
        self.scheduler.free(output.request_id)

    def stats(self) -> WorkerLoad:
        """A snapshot of the load; refits the cost model when due (engine thread only). The
        KV-load bandwidth is the worker's to fill in (engine.worker_runtime.worker_load)."""
        kv = self.scheduler.kv
        sched = self.scheduler
        last = self.step_stats.last
        return WorkerLoad(
            num_requests_running=len(self.scheduler.running),
            num_requests_waiting=len(self.scheduler.waiting),
            num_total_blocks=self.config.num_kv_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_free_blocks=kv.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_batched_tokens=last.num_new_tokens if last is not None and sched.num_unfinished else 0,
            num_waiting_tokens=self._num_waiting_tokens(),
            num_kv_tokens=sum(r.num_computed_tokens for r in sched.running),
            recent_step_time_s=self.step_stats.recent_step_time_s,
            max_num_seqs=self.config.max_num_seqs,
            cost_model=self.step_stats.model(
                max_num_batched_tokens=self.config.max_num_batched_tokens,
                kv_bytes_per_token=self.spec.block_bytes / self.spec.block_size,
            ),
        )

    def _num_waiting_tokens(self) -> int:
        """Tokens to compute before each waiting or prefilling request samples (a request with
        one token left is decoding and counts 0)."""
        sched = self.scheduler
        total = 0
        for request in (*sched.waiting, *sched.running):
            ext = sched.external_kv.get(request.request_id)
            left = request.num_tokens - max(request.num_computed_tokens, ext.num_tokens if ext else 0)
            total += left if left > 1 else 0
        return total
