"""What a routing decision is and what it is predicted to cost (docs/design.md §2 step 2, §7).

A :class:`Placement` names the decode worker and, when disaggregated, the prefill worker of one
request. :class:`Predictor` turns a candidate placement into predicted TTFT and TBT from the
workers' heartbeats (live load plus the step-time :class:`~core.cost_model.CostModel` each fits of
itself) and from this router's own placements still waiting for their first token
(router.placement.state, fresher than a heartbeat up to a second old). Everything here is plain
data and arithmetic: policies and tests drive it from hand-built :class:`WorkerInfo` values.

Predictions (seconds; DistServe §4 and Mooncake §5 split TTFT the same way):

    disaggregated on (P, D):  ttft = queue(P) + kv_load_P(pool-cached) + prefill_P(uncached)
                              handoff = kv_load_D(prompt)          (before the second token)
                              tbt = decode_step_D(batch + 1, kv_tokens + prompt)
    colocated on D:           ttft = queue(D) + prefill_D(uncached locally)
                                     + chunks x (running batch's share of each mixed step)
                              tbt = max(decode step, one mixed step: chunk + running batch)
                              (the mixed step: this prompt's chunk and those queued at D
                              ahead of it, up to D's token budget; fits only if it meets the
                              TBT SLO; without one, if it is at most
                              MAX_COLOCATED_STALL_STEPS decode steps)

``queue(W)`` drains the prompt tokens queued ahead at W: the larger of its heartbeat's
``num_waiting_tokens + num_batched_tokens`` and this router's pending tokens there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from core.cost_model import CostModel
from core.registry import WorkerInfo
from core.sampling_params import DEFAULT_MAX_TOKENS
from router.placement.state import PlacementView

DISAGGREGATED, COLOCATED = "disaggregated", "colocated"
DEFAULT_BLOCK_SIZE = 16  # a worker that does not say its block size (older heartbeat)
# Without a TBT SLO, a colocated mixed step may take at most this many of the running batch's
# decode steps (the running requests wait for it): a long uncached prompt goes to a prefill worker.
# 2 keeps a stream's token gaps within 2x its usual (4 let 1P+1D's TBT p99 reach 3.5x p50 on a
# 2-core EPYC; docs/bench.md).
MAX_COLOCATED_STALL_STEPS = 2.0


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the request's identity, prompt and prefix-cache state."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE  # of block_hashes
    block_hashes: tuple[int, ...] = ()  # the prompt's full blocks (core.block_hash chain)
    num_pool_cached_tokens: int = 0  # leading prompt tokens whose KV the pool holds

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; 0 turns one off."""

    ttft_s: float = 0.0
    tbt_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.tbt_s < 0:
            raise ValueError(f"SLOs must be >= 0 s, got ttft_s={self.ttft_s}, tbt_s={self.tbt_s}")


@dataclass(frozen=True)
class Prediction:
    """A candidate placement's predicted latencies (seconds) and whether the decode worker fits it."""

    ttft_s: float
    queue_s: float  # of ttft_s: waiting behind the work queued at the worker that prefills
    handoff_s: float  # decode worker loading the prompt's KV from the pool (disaggregated only)
    tbt_s: float  # decode step time with this request in the batch
    fits: bool  # the decode worker has the free blocks and a batch slot, and tbt_s meets the SLO
    num_cached_tokens: int  # prompt tokens not computed (pool or worker prefix cache)

    @property
    def rank_s(self) -> float:
        """What predicted-latency minimises: time until the decode worker can produce token 2."""
        return self.ttft_s + self.handoff_s

    def meets(self, slo: SLO) -> bool:
        """Whether the decode side fits (TBT SLO, blocks, batch slot) and the predicted TTFT
        is within the TTFT SLO (0: none)."""
        return self.fits and (not slo.ttft_s or self.ttft_s <= slo.ttft_s)


@dataclass(frozen=True, eq=False)  # identity: the router keys its bookkeeping by placement
class Placement:
    """Where one request runs; ``prefill`` None is colocated (the decode worker prefills)."""

    decode: WorkerInfo
    prefill: WorkerInfo | None
    policy: str
    prediction: Prediction | None = None  # None: a worker has no fitted cost model yet
    block_hashes: tuple[int, ...] = ()  # the prompt's full blocks (set by the Placer)

    @property
    def mode(self) -> str:
        return COLOCATED if self.prefill is None else DISAGGREGATED


def num_requests(worker: WorkerInfo, view: PlacementView) -> int:
    """Running + waiting at its last heartbeat less those this router saw end there since, or
    this router's in flight there if more; plus the requests this router placed there that have
    not reached it yet (a decode worker's, prefilling elsewhere)."""
    ended, _ = view.ended_since(worker.address, worker.heartbeat_time_s)
    at_worker = max(worker.load.num_requests - ended, view.in_flight(worker.address))
    return at_worker + view.awaiting_decode(worker.address)


def drain_s(cost: CostModel, num_tokens: float) -> float:
    """Seconds to compute ``num_tokens`` queued prompt tokens in budget-sized steps (attention
    of the queued prompts is not known and left out)."""
    if num_tokens <= 0:
        return 0.0
    steps = math.ceil(num_tokens / max(1, cost.max_num_batched_tokens))
    return steps * (cost.base_s + cost.per_seq_s) + cost.per_token_s * num_tokens


class Predictor:
    """Predicts candidate placements from the heartbeats and the router's bookkeeping (read only)."""

    def __init__(self, view: PlacementView, slo: SLO = SLO()):
        self.view, self.slo = view, slo

    def queued_tokens(self, worker: WorkerInfo) -> float:
        """Prompt tokens ahead of a new request at ``worker``: its heartbeat's waiting tokens (plus
        the pass in progress on a prefill worker) less those this router saw prefilled there
        since, or this router's pending placements there, whichever is larger."""
        heartbeat = worker.load.num_waiting_tokens
        if worker.role == "prefill":  # the pass in progress finishes first
            heartbeat += worker.load.num_batched_tokens
        _, ended = self.view.ended_since(worker.address, worker.heartbeat_time_s)  # prefilled since
        return max(heartbeat - ended, self.view.pending_tokens(worker.address))

    def _decode_side(self, decode: WorkerInfo, cost: CostModel, request: RoutingRequest) -> tuple[float, int, bool]:
        """(step time with the request added, running batch, fits: blocks, slot and TBT)."""
        load = decode.load
        batch = num_requests(decode, self.view)
        tbt_s = cost.decode_step_s(batch + 1, load.num_kv_tokens + request.num_prompt_tokens)
        block_size = decode.block_size or request.block_size
        blocks_needed = -(-(request.num_prompt_tokens + request.max_tokens) // block_size)
        free_ok = load.num_free_blocks is None or load.num_free_blocks >= blocks_needed
        slot_ok = load.max_num_seqs is None or batch < load.max_num_seqs
        tbt_ok = not self.slo.tbt_s or tbt_s <= self.slo.tbt_s
        return tbt_s, batch, free_ok and slot_ok and tbt_ok

    def decode_fit(self, decode: WorkerInfo, request: RoutingRequest) -> tuple[float, bool] | None:
        """(predicted decode step with the request added, fits: blocks, slot and TBT SLO) of
        ``decode``; None without a cost model."""
        cost = decode.load.fitted_cost_model
        if cost is None:
            return None
        tbt_s, _, fits = self._decode_side(decode, cost, request)
        return tbt_s, fits

    def disaggregated(self, prefill: WorkerInfo, decode: WorkerInfo, request: RoutingRequest) -> Prediction | None:
        """Prefill on ``prefill`` (cached prefix loaded from the pool), decode on ``decode``;
        None when either has no cost model."""
        first = self.prefill_ttft(prefill, request)
        d_cost = decode.load.fitted_cost_model
        if first is None or d_cost is None:
            return None
        ttft_s, queue_s, cached = first
        tbt_s, _, fits = self._decode_side(decode, d_cost, request)
        return Prediction(ttft_s, queue_s, d_cost.kv_load_s(request.num_prompt_tokens), tbt_s, fits, cached)

    def prefill_ttft(self, prefill: WorkerInfo, request: RoutingRequest) -> tuple[float, float, int] | None:
        """(TTFT, its queue part, cached tokens) of prefilling on ``prefill``; None without a cost model."""
        cost = prefill.load.fitted_cost_model
        if cost is None:
            return None
        n = request.num_prompt_tokens
        cached = max(0, min(request.num_pool_cached_tokens, n - 1))  # the last token is always computed
        queue_s = drain_s(cost, self.queued_tokens(prefill))
        return queue_s + cost.kv_load_s(cached) + cost.prefill_s(n - cached, cached), queue_s, cached

    def colocated(self, decode: WorkerInfo, request: RoutingRequest, num_local_cached_tokens: int) -> Prediction | None:
        """Prefill on ``decode`` itself after the ``num_local_cached_tokens`` its prefix cache
        holds, chunked into its decode steps (Sarathi-Serve); None without a cost model."""
        cost = decode.load.fitted_cost_model
        if cost is None:
            return None
        n = request.num_prompt_tokens
        cached = max(0, min(num_local_cached_tokens, n - 1))
        uncached = n - cached
        queued = self.queued_tokens(decode)
        queue_s = drain_s(cost, queued)
        tbt_s, batch, fits = self._decode_side(decode, cost, request)
        running_kv_tokens = decode.load.num_kv_tokens
        # Each mixed step also carries the running batch: its share is a decode step less the base.
        share_s = max(0.0, cost.decode_step_s(batch, running_kv_tokens) - cost.base_s) if batch else 0.0
        budget = max(1, cost.max_num_batched_tokens)
        # The engine fills a mixed step with the chunks of every prompt queued there, up to its
        # token budget: the running decodes wait for all of them, not for this prompt alone.
        chunk = min(queued + uncached, budget)
        chunks = math.ceil(uncached / budget)
        ttft_s = queue_s + cost.prefill_s(uncached, cached) + chunks * share_s
        mixed_step_s = cost.prefill_s(chunk, cached) + share_s  # what running decodes wait for
        if self.slo.tbt_s:
            fits = fits and mixed_step_s <= self.slo.tbt_s
        elif batch:  # no TBT SLO: still never stall running decodes by many steps' worth
            fits = fits and mixed_step_s <= MAX_COLOCATED_STALL_STEPS * cost.decode_step_s(batch, running_kv_tokens)
        return Prediction(ttft_s, queue_s, 0.0, max(tbt_s, mixed_step_s), fits, cached)
