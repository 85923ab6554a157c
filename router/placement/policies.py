"""Routing policies: where a request runs (docs/design.md §2 step 2; docs/style.md principle 2:
"a policy is an object").

Every policy answers two questions behind :class:`RoutingPolicy`:

- ``place``: the decode worker and, unless colocated, the prefill worker of a new request;
- ``choose``: one worker of one role (a retry after a worker failed, a decode stream migrating).

Four policies, selected by ``RouterConfig.routing_policy``:

- ``round_robin``: each role's workers in turn;
- ``least_loaded``: fewest running + waiting requests (heartbeat, or this router's in flight);
- ``cache_aware``: the longest prompt prefix this router recently sent to the worker (SGLang's
  cache-aware router, without its load-balance override), ties by load;
- ``predicted_latency`` (default): the minimum predicted TTFT (placement.Predictor) among the
  placements whose decode worker meets the TBT SLO and has the free blocks, colocated placements
  included (conditional disaggregation, DistServe §4.3 / Mooncake §5); predictions within
  ``TIE_REL`` of the best are ties, broken in favour of disaggregation, then by load, so one hot
  prefix cannot take every request.
  Until every worker has a fitted cost model it behaves as ``least_loaded``.

``disaggregation``: ``auto`` (policies that predict may colocate; the others disaggregate when a
prefill worker is live), ``always`` (colocated only when no prefill worker is live), ``never``.
"""

from __future__ import annotations

import abc
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from core.registry import WorkerInfo
from router.config import DISAGGREGATION_MODES
from router.placement.prediction import SLO, Placement, Prediction, Predictor, RoutingRequest, num_requests
from router.placement.state import PlacementView

__all__ = [
    "DISAGGREGATION_MODES", "POLICIES", "CacheAwarePolicy", "LeastLoadedPolicy", "PredictedLatencyPolicy",
    "RoundRobinPolicy", "RoutingPolicy", "RoutingRequest", "make_policy",
]

TIE_REL = 0.10  # predictions within 10 % (plus TIE_ABS_S) of the best are ties
TIE_ABS_S = 0.005


class RoutingPolicy(abc.ABC):
    """Chooses workers for requests; subclasses set ``name`` and implement ``choose``.

    A policy reads the router's bookkeeping through ``view`` and mutates nothing but its own
    state (round robin's turn); the caller (router.placement.placer.Placer) passes non-empty worker lists
    and records what was placed.

    Raises:
        ValueError: ``disaggregation`` is not one of DISAGGREGATION_MODES.
    """

    name: str = "abstract"

    def __init__(self, view: PlacementView, disaggregation: str = "auto", slo: SLO = SLO()):
        if disaggregation not in DISAGGREGATION_MODES:
            raise ValueError(f"disaggregation must be one of {DISAGGREGATION_MODES}, got {disaggregation!r}")
        self.view, self.disaggregation = view, disaggregation
        self.predictor = Predictor(view, slo)

    @abc.abstractmethod
    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        """Returns one of ``workers`` (all of one role, at least one)."""

    def place(
        self, prefill_workers: Sequence[WorkerInfo], decode_workers: Sequence[WorkerInfo], request: RoutingRequest
    ) -> Placement:
        """A decode worker, and a prefill worker unless colocated; predicted when every worker
        involved has a cost model (for admission and metrics).

        ``decode_workers`` holds at least one worker; ``prefill_workers`` may be empty.
        """
        prefill = None
        if prefill_workers and self.disaggregation != "never":
            prefill = self.choose(prefill_workers, request)
        decode = self.choose(decode_workers, request)
        return Placement(decode, prefill, self.name, self.predict(prefill, decode, request))

    def predict(self, prefill: WorkerInfo | None, decode: WorkerInfo, request: RoutingRequest) -> Prediction | None:
        predictor = self.predictor
        if prefill is not None:
            return predictor.disaggregated(prefill, decode, request)
        return predictor.colocated(decode, request, self.local_cached_tokens(decode, request))

    def local_cached_tokens(self, worker: WorkerInfo, request: RoutingRequest) -> int:
        """Leading prompt tokens this router recently sent to ``worker`` (its prefix cache, roughly)."""
        return self.view.local_cached_blocks(worker.address, request.block_hashes) * request.block_size

    def load(self, worker: WorkerInfo) -> int:
        return num_requests(worker, self.view)

    def least_loaded(self, workers: Sequence[WorkerInfo]) -> WorkerInfo:
        """Fewest requests, then the most free KV blocks, then the smallest worker_id."""
        return min(workers, key=lambda w: (self.load(w), -(w.load.num_free_blocks or 0), w.worker_id))


class RoundRobinPolicy(RoutingPolicy):
    """Each role's workers in turn (by worker_id), whatever their load."""

    name = "round_robin"

    def __init__(self, view: PlacementView, disaggregation: str = "auto", slo: SLO = SLO()):
        super().__init__(view, disaggregation, slo)
        self._turns: dict[str, itertools.count] = {}

    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        turn = next(self._turns.setdefault(workers[0].role, itertools.count()))
        return sorted(workers, key=lambda w: w.worker_id)[turn % len(workers)]


class LeastLoadedPolicy(RoutingPolicy):
    """The worker with the fewest requests: running + waiting (its last heartbeat), or this
    router's own in-flight requests to it when more. Ties go to the most free KV blocks, then
    worker_id."""

    name = "least_loaded"

    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        return self.least_loaded(workers)


class CacheAwarePolicy(RoutingPolicy):
    """The worker holding the longest prefix of the prompt (as far as this router sent it
    there), then the least loaded."""

    name = "cache_aware"

    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        best = max(self.local_cached_tokens(w, request) for w in workers)
        return self.least_loaded([w for w in workers if self.local_cached_tokens(w, request) == best])


@dataclass(frozen=True)
class _Candidate:
    prefill: WorkerInfo | None
    decode: WorkerInfo
    prediction: Prediction
    load: tuple[int, int]  # (requests at the worker that prefills, at the decode worker)


class PredictedLatencyPolicy(RoutingPolicy):
    """Minimum predicted TTFT subject to the decode worker's TBT SLO and free blocks."""

    name = "predicted_latency"

    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        """One role only (a retry): prefill workers by predicted prefill latency, decode workers
        by fitting then predicted step time; least loaded without cost models."""
        predictor = self.predictor
        if workers[0].role == "prefill":
            predictions = [predictor.prefill_ttft(w, request) for w in workers]
            keys = [None if p is None else (p[0],) for p in predictions]
        else:
            fits = [predictor.decode_fit(w, request) for w in workers]
            keys = [None if f is None else (not f[1], f[0]) for f in fits]
        if any(k is None for k in keys):
            return self.least_loaded(workers)
        return min(zip(keys, workers), key=lambda kw: (*kw[0], self.load(kw[1]), kw[1].worker_id))[1]

    def place(
        self, prefill_workers: Sequence[WorkerInfo], decode_workers: Sequence[WorkerInfo], request: RoutingRequest
    ) -> Placement:
        mode = self.disaggregation
        pairs: list[tuple[WorkerInfo | None, WorkerInfo]] = []
        if prefill_workers and mode != "never":
            pairs += [(p, d) for p in prefill_workers for d in decode_workers]
        if not prefill_workers or mode != "always":
            pairs += [(None, d) for d in decode_workers]
        candidates = []
        for prefill, decode in pairs:
            prediction = self.predict(prefill, decode, request)
            if prediction is None:  # a worker without a fitted cost model yet
                return self._least_loaded_placement(prefill_workers, decode_workers, request)
            load = (self.load(prefill or decode), self.load(decode))
            candidates.append(_Candidate(prefill, decode, prediction, load))
        best = self.best(candidates)
        return Placement(best.decode, best.prefill, self.name, best.prediction)

    def best(self, candidates: list[_Candidate]) -> _Candidate:
        """Among those meeting the SLOs (else those that fit the decode worker, else all): the
        lowest predicted latency, predictions within TIE_REL of it tied; ties prefer the
        disaggregated path (colocation must be clearly faster: an idle cluster still fills the
        pool), then the least load."""
        slo = self.predictor.slo
        pool = ([c for c in candidates if c.prediction.meets(slo)] or [c for c in candidates if c.prediction.fits]
                or candidates)
        best_s = min(c.prediction.rank_s for c in pool)
        tied = [c for c in pool if c.prediction.rank_s <= best_s * (1 + TIE_REL) + TIE_ABS_S]
        return min(tied, key=lambda c: (c.prefill is None, sum(c.load), c.prediction.rank_s, c.decode.worker_id,
                                        c.prefill.worker_id if c.prefill else ""))

    def _least_loaded_placement(self, prefill_workers, decode_workers, request) -> Placement:
        prefill = None
        if prefill_workers and self.disaggregation != "never":
            prefill = self.least_loaded(prefill_workers)
        return Placement(self.least_loaded(decode_workers), prefill, self.name, None)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p for p in (RoundRobinPolicy, LeastLoadedPolicy, CacheAwarePolicy, PredictedLatencyPolicy)
}


def make_policy(name: str, view: PlacementView, disaggregation: str = "auto", slo: SLO = SLO()) -> RoutingPolicy:
    """The policy called ``name``, reading the bookkeeping through ``view``.

    Raises:
        ValueError: an unknown ``name`` (naming the known ones) or ``disaggregation``.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name](view, disaggregation, slo)
