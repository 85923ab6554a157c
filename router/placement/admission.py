"""SLO admission: reject early what would miss its SLO anyway (DistServe §4; Mooncake §6,
"early rejection").

A placement comes with its prediction (placement.Predictor). The request is refused, before any
worker sees it, when both hold:

1. the placement does not meet the SLOs (predicted TTFT above ``slo.ttft_s``, or its decode
   worker cannot take it within ``slo.tbt_s`` / its free blocks) -- the policy picked the best
   placement, so none does;
2. the work queued ahead of it takes longer than ``max_queue_s`` to drain: the miss comes from
   overload, not from a prompt that is simply long (a long prompt on an idle cluster is served).

The refusal (HTTP 429, gRPC RESOURCE_EXHAUSTED) says when to retry: when the queue ahead has
drained (its predicted drain time, at least 1 s). No SLO set, or no prediction (no cost model
fitted yet): everything is admitted.
"""

from __future__ import annotations

from router.errors import ErrorKind, RouterError
from router.placement.prediction import SLO, Placement


class Admission:
    """Admits or refuses placements; stateless."""

    def __init__(self, slo: SLO = SLO(), max_queue_s: float = 0.5):
        if max_queue_s < 0:
            raise ValueError(f"max_queue_s must be >= 0, got {max_queue_s}")
        self.slo, self.max_queue_s = slo, max_queue_s

    @property
    def enabled(self) -> bool:
        return bool(self.slo.ttft_s or self.slo.tbt_s)

    def check(self, placement: Placement, request_id: str) -> None:
        """Returns when ``placement`` is admitted.

        Raises:
            RouterError: SLO_UNATTAINABLE with ``retry_after_s`` = the predicted queue drain time.
        """
        p = placement.prediction
        if not self.enabled or p is None or p.meets(self.slo) or p.queue_s <= self.max_queue_s:
            return
        why = []
        if self.slo.ttft_s and p.ttft_s > self.slo.ttft_s:
            why.append(f"predicted TTFT {p.ttft_s:.3f} s > SLO {self.slo.ttft_s:g} s")
        if not p.fits:
            why.append(f"decode worker {placement.decode.worker_id} cannot take it "
                       f"(predicted TBT {p.tbt_s:.3f} s, SLO {self.slo.tbt_s:g} s, or no free blocks/slot)")
        raise RouterError(
            f"request {request_id} refused: {'; '.join(why)}; the queue ahead takes {p.queue_s:.3f} s "
            f"(bound {self.max_queue_s:g} s)",
            ErrorKind.SLO_UNATTAINABLE, retry_after_s=max(1.0, p.queue_s),
        )
