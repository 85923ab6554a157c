"""A prefill-worker shortage never silently changes mode.

Once this router has seen a prefill worker, a request that runs colocated because none is live
(``no_prefill_worker``) or because its prefill failed with no other prefill worker left
(``prefill_failed``), or because its prefill worker could not write the KV to the pool
(``pool_write_failed``: the pool broke, the worker did not; the decode worker needs no pool) is a
**fall-back**: counted in ``tandem:colocated_fallbacks_total{reason}``
and shown by ``GET /health`` (``mode: "colocated_fallback"`` while no prefill worker is live,
and the counts). A cluster that never had a prefill worker (``tandem up --colocated``) is simply
colocated, and ``--disaggregation never`` chooses colocation: neither is a fall-back.
"""

from __future__ import annotations

from collections import Counter

from router.metrics import RouterMetrics

REASONS = ("no_prefill_worker", "prefill_failed", "pool_write_failed")


class ColocatedFallbacks:
    """Counts fall-backs to colocated prefill; mutated by Generation, read by /health."""

    def __init__(self, metrics: RouterMetrics):
        self.metrics = metrics
        self.seen_prefill = False  # a prefill worker was live at some placement
        self.counts: Counter[str] = Counter()

    def placed(self, num_prefill_workers: int, colocated: bool) -> None:
        """One placement: counts a ``no_prefill_worker`` fall-back when it is colocated with no
        prefill worker live after one was seen. Mutates: seen_prefill, counts, the metric."""
        if num_prefill_workers:
            self.seen_prefill = True
        elif colocated and self.seen_prefill:
            self.count("no_prefill_worker")

    def count(self, reason: str) -> None:
        if reason not in REASONS:
            raise ValueError(f"reason must be one of {REASONS}, got {reason!r}")
        self.counts[reason] += 1
        self.metrics.colocated_fallbacks.labels(reason=reason).inc()

    def mode(self, num_prefill_workers: int) -> str:
        """disaggregated, colocated (never had a prefill worker) or colocated_fallback."""
        if num_prefill_workers:
            return "disaggregated"
        return "colocated_fallback" if self.seen_prefill else "colocated"
