"""The one module where the simulator touches Tandem's real scheduling classes.

Everything the simulation decides about batching, chunking, preemption, prefix caching,
placement and admission is decided by the production code, unmodified:

- ``engine.scheduler.Scheduler`` (with its ``KVCacheManager``/``BlockPool`` and batching policy)
  builds every step of every simulated worker; :class:`SimEngine` only times the step (a
  ``StepTimer``) and feeds back a ``ModelRunnerOutput`` whose sampled token is a constant.
- ``router.placement.placer.Placer`` with a ``router.placement.policies`` policy and ``router.placement.admission.Admission``
  places and admits every request, writing its own ``router.placement.state.PlacementBook``;
  :class:`SimRouter` hands it ``WorkerInfo`` heartbeats whose ``load`` is a
  ``core.worker_load.WorkerLoad`` built from the simulated schedulers (as
  ``engine.engine.LLMEngine.stats`` builds it) and drives its coroutine to completion without an
  event loop (nothing in it awaits real I/O).

The Scheduler is read through its public accessors, except in the bulk-decode fast path
(:meth:`SimEngine.decode_run_steps` / :meth:`SimEngine.advance_decode`), which reads its running
requests and block tables and advances them in place, and the prefix-cache counters (its
``KVCacheManager``'s); no accessor covers those.

When the engine or router APIs change, this module is the one to update.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from core.cost_model import CostModel, prefill_attn_pairs
from core.registry import WorkerInfo
from core.worker_load import WorkerLoad
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.outputs import ExternalKV, ModelRunnerOutput, SampledToken, SchedulerOutput
from engine.preemption import PreemptionPolicy
from engine.scheduler import Scheduler
from router.placement.admission import Admission
from router.placement.prediction import SLO, Placement
from router.placement.state import PlacementBook
from router.placement.placer import Placer
from router.placement.policies import make_policy
from sim.hardware import StepFeatures

SAMPLED_TOKEN_ID = 1  # every simulated step samples this token (outputs run to max_tokens)
SIM_SPEC_FINGERPRINT = "sim"

# What tests/unit/sim checks are the production classes, not copies.
REAL_CLASSES = {"Scheduler": Scheduler, "Placer": Placer, "Admission": Admission, "PlacementBook": PlacementBook}


class StepTimer(Protocol):
    def step_s(self, features: StepFeatures) -> float:
        """Seconds one step with these features takes."""
        ...


class CostModelTimer:
    """Step times from a fitted :class:`core.cost_model.CostModel` (a worker's calibration)."""

    def __init__(self, cost: CostModel):
        self.cost = cost

    def step_s(self, f: StepFeatures) -> float:
        return self.cost.step_s(f.num_new_tokens, f.num_seqs, f.attn_pairs) if f.num_seqs else 0.0


def step_size(num_new_tokens: int, num_seqs: int) -> tuple[str, int]:
    """The kind and size a measured pass-time ratio is matched by: ``("decode", batch size)`` for
    a step of one new token per sequence, else ``("prefill", new tokens)`` (prompt tokens,
    chunks or whole prompts, with or without decodes beside them)."""
    return ("decode", num_seqs) if num_new_tokens == num_seqs else ("prefill", num_new_tokens)


class JitteredTimer:
    """Another timer's step times, each multiplied by a ratio drawn at random from the measured
    pass / fit ratios of the real passes nearest to it: a residual bootstrap (Efron, 1979) with
    k-nearest-neighbour residuals, so the simulated steps keep the measured spread and skew (a
    pass now and then 1.3-1.6x its fit) and what a linear fit gets systematically wrong by size.
    Here a 2-sequence decode pass ran 1.1x the fit at the median and a 3-sequence one 0.9x (MKL's
    fp32 GEMM is not linear in the rows); prompt steps of 13-60 tokens ran 1.2-1.7x, of 200-600
    0.85-1.05x and of 800+ 1.2-1.6x. One ratio drawn from all prompt steps would put the short
    ones' overrun on every prompt.

    ``samples``: kind -> (size, ratio) of each measured pass (:func:`step_size`;
    ``benchmarks/step_timeline.py``'s ``pass_over_fit``). A step draws from the ``k`` passes of
    its kind nearest in log size, and every pass tied with the k-th (all the 1-sequence decode
    passes for a 1-sequence step); a kind with no pass draws from the other's; none at all:
    ratio 1. Draws come from ``random.Random(seed)`` in call order: one simulation is
    deterministic, and a few seeds give the spread one measured run is a draw of.

    Raises:
        ValueError: a ratio or a size <= 0, or k < 1.
    """

    def __init__(self, timer: StepTimer, samples: Mapping[str, Sequence[tuple[int, float]]], seed: int = 0,
                 k: int = 8):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if any(size <= 0 or ratio <= 0 for pairs in samples.values() for size, ratio in pairs):
            raise ValueError("pass sizes and pass / fit ratios must be > 0")
        self.timer, self.k = timer, k
        self._rng = random.Random(seed)
        self._sorted = {kind: sorted((math.log(size), ratio) for size, ratio in pairs)
                        for kind, pairs in samples.items() if pairs}
        self._nearest: dict[tuple[str, int], Sequence[float]] = {}

    def ratios_for(self, kind: str, size: int) -> Sequence[float]:
        """The ratios a step of ``kind`` and ``size`` draws from."""
        key = (kind, size)
        if key not in self._nearest:
            pairs = self._sorted.get(kind) or next(iter(self._sorted.values()), None)
            self._nearest[key] = self._k_nearest(pairs, math.log(size)) if pairs else (1.0,)
        return self._nearest[key]

    def _k_nearest(self, pairs: list[tuple[float, float]], x: float) -> list[float]:
        distances = sorted(abs(px - x) for px, _ in pairs)
        cutoff = distances[min(self.k, len(distances)) - 1] + 1e-12
        return [ratio for px, ratio in pairs if abs(px - x) <= cutoff]

    def step_s(self, features: StepFeatures) -> float:
        base_s = self.timer.step_s(features)
        if not base_s:
            return base_s
        return base_s * self._rng.choice(self.ratios_for(*step_size(features.num_new_tokens, features.num_seqs)))


def run_sync(coroutine):
    """Runs a coroutine that never suspends (no real I/O) to completion; returns its value.

    Raises:
        RuntimeError: the coroutine suspended (it awaited something real).
    """
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a simulated router call awaited real I/O")


def step_features(out: SchedulerOutput) -> StepFeatures:
    """The cost-model features of a scheduled, not yet applied step (as ModelRunner.prepare
    takes them)."""
    pairs, kv_read = 0.0, 0
    for s in out.scheduled:
        c = s.num_computed_tokens
        pairs += prefill_attn_pairs(s.num_new_tokens, c)
        kv_read += c + s.num_new_tokens
    return StepFeatures(out.num_scheduled_tokens, len(out.scheduled), pairs, kv_read)


class SimEngine:
    """One simulated worker's real Scheduler. Not thread-safe; the simulator's loop drives it."""

    def __init__(self, config: EngineConfig):
        self.config = config
        # Preempted requests are recomputed (no swap: it needs a swap space of real KV bytes).
        self.scheduler = Scheduler(config, PreemptionPolicy("recompute"))
        self.last_num_batched_tokens = 0

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, output_token_ids: Sequence[int] = (),
            num_external_tokens: int = 0) -> None:
        """Queues a request whose first ``num_external_tokens`` tokens' KV arrive with it (the pool).

        Raises:
            ValueError: it cannot fit max_model_len (the Scheduler's check).
        """
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        # A list, as a real worker's Request holds (a lazy TracePrompt made every len() and slice
        # of the scheduler's hot path a Python call); only in-flight requests hold one.
        request = Request(request_id, list(prompt), params, output_token_ids=list(output_token_ids))
        external = None
        if num_external_tokens:
            num_blocks = -(-num_external_tokens // self.config.block_size)
            external = ExternalKV(num_external_tokens, [b""] * num_blocks)
        self.scheduler.add_request(request, external)

    def schedule(self) -> tuple[SchedulerOutput, StepFeatures]:
        """The next step (the real ``Scheduler.schedule``) and its features. Mutates the scheduler."""
        out = self.scheduler.schedule()
        features = step_features(out)
        self.last_num_batched_tokens = features.num_new_tokens
        return out, features

    def apply(self, out: SchedulerOutput) -> list[tuple[str, bool]]:
        """Applies a finished step: (request_id, finished) per sampled token. Finished requests
        are freed (their blocks return to the pool's free/cached lists)."""
        sampled = {s.request_id: SampledToken(SAMPLED_TOKEN_ID) for s in out.scheduled if s.samples}
        outputs = self.scheduler.update_from_output(out, ModelRunnerOutput(sampled))
        for o in outputs:
            if o.finished:
                self.scheduler.free(o.request_id)
        return [(o.request_id, o.finished) for o in outputs]

    # The bulk-decode fast path (decode_run_steps, decode_run_features, advance_decode) reaches
    # into the Scheduler: it reads ``running`` (the live Requests) and ``kv`` (their block tables,
    # the free blocks) and advances them in place, as ``num_steps`` schedule/update_from_output
    # rounds would. The Scheduler has no public accessor for that; when its internals change,
    # tests/unit/sim's bulk-vs-step-by-step test is what catches a drift here.

    def decode_run_steps(self) -> int:
        """How many whole decode steps may be applied in bulk (:meth:`advance_decode`): those in
        which nothing but one token per running request can happen. 0 unless no request waits,
        every running one is decoding, all fit the token budget, and the blocks for every step
        are free (so no step could preempt); the step in which a request would reach
        max_tokens or max_model_len is left to :meth:`schedule` (it finishes there)."""
        s, config = self.scheduler, self.config
        if s.num_waiting or not s.num_running or s.num_running > config.max_num_batched_tokens:
            return 0
        steps = config.max_model_len
        for r in s.running:  # reaches in (see above)
            if r.num_computed_tokens != r.num_tokens - 1:
                return 0
            steps = min(steps, r.sampling_params.max_tokens - r.num_output_tokens - 1,
                        config.max_model_len - r.num_tokens - 1)
        if steps <= 0:
            return 0
        bs = config.block_size
        needed = sum(max(0, -(-(r.num_tokens + steps) // bs) - len(s.block_ids(r.request_id))) for r in s.running)
        return steps if needed <= s.block_usage()[1] else 0

    def decode_run_features(self, num_steps: int) -> list[StepFeatures]:
        """The features of the next ``num_steps`` decode steps of the running batch."""
        batch, context = self.scheduler.num_running, self.scheduler.num_kv_tokens
        return [StepFeatures(batch, batch, prefill_attn_pairs(1, 0) * batch + (context + i * batch) / 1000,
                             context + (i + 1) * batch) for i in range(num_steps)]

    def advance_decode(self, num_steps: int) -> list[str]:
        """Applies ``num_steps`` (at most :meth:`decode_run_steps`) decode steps at once, leaving
        the scheduler as ``num_steps`` schedule/update_from_output rounds would: each running
        request has ``num_steps`` more tokens, computed and block-cached, in blocks allocated
        from the pool. Returns the running request ids (each got ``num_steps`` tokens)."""
        kv = self.scheduler.kv  # reaches in (see above)
        for r in self.scheduler.running:
            kv.allocate_slots(r.request_id, r.num_computed_tokens + num_steps)
            r.output_token_ids.extend([SAMPLED_TOKEN_ID] * num_steps)
            r.num_computed_tokens += num_steps
            kv.cache_full_blocks(r)
        return [r.request_id for r in self.scheduler.running]

    @property
    def num_unfinished(self) -> int:
        return self.scheduler.num_unfinished

    @property
    def num_used_blocks(self) -> int:
        """Blocks some request holds (cached-but-free ones are not counted)."""
        return self.scheduler.block_usage()[0]

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    def prefix_hit_rate(self) -> tuple[int, int]:
        """(prompt tokens looked up, of them hit) in this worker's prefix cache (the counters of
        the Scheduler's KVCacheManager: the Scheduler has no accessor for them)."""
        kv = self.scheduler.kv
        return kv.num_prefix_queries_tokens, kv.num_prefix_hit_tokens

    def load(self, cost: CostModel) -> WorkerLoad:
        """The heartbeat load of this scheduler, built as ``engine.engine.LLMEngine.stats`` builds
        it (the step time is the simulator's, so ``recent_step_time_s`` stays 0; ``cost`` is the
        worker's fitted cost model)."""
        s = self.scheduler
        num_used_blocks, num_free_blocks = s.block_usage()
        return WorkerLoad(
            num_requests_running=s.num_running, num_requests_waiting=s.num_waiting,
            num_total_blocks=self.config.num_kv_blocks, num_used_blocks=num_used_blocks,
            num_free_blocks=num_free_blocks, num_preemptions=s.num_preemptions,
            num_batched_tokens=self.last_num_batched_tokens if s.num_unfinished else 0,
            num_waiting_tokens=s.num_waiting_tokens, num_kv_tokens=s.num_kv_tokens,
            recent_step_time_s=0.0, max_num_seqs=self.config.max_num_seqs, cost_model=cost,
        )


def worker_info(worker_id: str, role: str, block_size: int) -> WorkerInfo:
    """A registry entry for a simulated worker (its address is its id)."""
    return WorkerInfo(worker_id, role, worker_id, spec_fingerprint=SIM_SPEC_FINGERPRINT, block_size=block_size)


class _PoolIndex:
    """The router's view of the pool's block index (router.placement.prefix_index.PoolPrefixIndex's API);
    keeps the last prompt's block hashes so the simulated pool need not hash it again."""

    def __init__(self, num_cached_blocks):
        self._num_cached_blocks = num_cached_blocks
        self.last_hashes: Sequence[int] = ()

    async def num_cached_blocks(self, spec_fingerprint: str, block_hashes: Sequence[int]) -> int:
        self.last_hashes = block_hashes
        return self._num_cached_blocks(block_hashes)


class SimRouter:
    """The real Placer (policy + admission) over simulated workers."""

    def __init__(self, policy: str, disaggregation: str, slo: SLO, max_queue_s: float,
                 pool_num_cached_blocks=None, prefix_cache_blocks: int = 8192):
        book = PlacementBook(prefix_cache_blocks)  # as router.server builds it
        self._index = _PoolIndex(pool_num_cached_blocks) if pool_num_cached_blocks else None
        self.placer = Placer(book, make_policy(policy, book.view, disaggregation, slo), Admission(slo, max_queue_s),
                             pool_index=self._index)
        self._tracking: dict[tuple[str, str], object] = {}

    def place(self, request_id: str, prompt: Sequence[int], max_tokens: int, prefill: Sequence[WorkerInfo],
              decode: Sequence[WorkerInfo]) -> tuple[Placement, Sequence[int]]:
        """Where the request runs, and the prompt's block hashes (empty without a pool). Mutates
        the router's bookkeeping (pending prefills, local prefix view).

        Raises:
            RouterError: refused (SLO admission) or no decode worker.
        """
        placement = run_sync(self.placer.place(request_id, prompt, max_tokens, prefill, decode))
        return placement, self._index.last_hashes if self._index else ()

    def track(self, request_id: str, address: str) -> None:
        """Counts the request in flight at ``address`` (the router's ``placer.attempt``) until
        :meth:`untrack`."""
        manager = self.placer.attempt(address)
        manager.__enter__()
        self._tracking[(request_id, address)] = manager

    def untrack(self, request_id: str, address: str) -> None:
        manager = self._tracking.pop((request_id, address), None)
        if manager is not None:
            manager.__exit__(None, None, None)

    def decoding(self, placement: Placement, address: str) -> None:
        """The decode worker at ``address`` starts the request (the router's ``placer.decoding``)."""
        self.placer.decoding(address, placement)

    def first_token(self, placement: Placement, ttft_s: float) -> None:
        self.placer.first_token(placement, ttft_s)

    def finished(self, placement: Placement) -> None:
        self.placer.finished(placement)
