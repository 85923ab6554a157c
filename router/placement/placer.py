"""The router's placement step: prefix lookup, routing policy, SLO admission, bookkeeping.

:class:`Placer` is what ``Generation`` calls once per request before any worker sees it
(``place``), when a role's worker must be chosen again after a failure (``choose``), around each
worker attempt (``attempt``), at the first token and at the end (``first_token``, ``finished``).
It owns the placement bookkeeping (router.placement.state.PlacementBook: the only writer), the
async part (the pool index in Redis), the metrics and the one "no healthy worker" check; the
decisions themselves are the policy's (router.placement.policies, reading the bookkeeping through a
read-only view) and the admission's (router.placement.admission).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Sequence

from core.registry import WorkerInfo
from router.placement.admission import Admission
from router.errors import ErrorKind, RouterError
from router.metrics import RouterMetrics
from router.placement.prediction import DEFAULT_BLOCK_SIZE, Placement, RoutingRequest
from router.placement.state import PlacementBook
from router.placement.prefix_index import PoolPrefixIndex, prompt_block_hashes
from router.placement.policies import RoutingPolicy

log = logging.getLogger(__name__)


def kv_spec_of(workers: Sequence[WorkerInfo]) -> tuple[str, int]:
    """(spec_fingerprint, block_size) the workers advertise (the first that does); ("", 16)
    when none does (an older worker): hashes still serve the local prefix view."""
    for worker in workers:
        if worker.block_size > 0:
            return worker.spec_fingerprint, worker.block_size
    return "", DEFAULT_BLOCK_SIZE


# When a client may retry a request refused for want of a worker (HTTP Retry-After, gRPC
# retry-after): the router re-reads the registry every half second, and a restarted worker
# registers once its model is loaded and calibrated (10-20 s for the default model on 2 cores).
NO_WORKER_RETRY_AFTER_S = 5.0


def require_workers(role: str, workers: Sequence[WorkerInfo]) -> None:
    """Raises RouterError(NO_WORKER, retry after NO_WORKER_RETRY_AFTER_S) when ``workers`` (the
    live ones of ``role``) is empty."""
    if not workers:
        raise RouterError(f"no healthy {role} worker is registered", ErrorKind.NO_WORKER,
                          retry_after_s=NO_WORKER_RETRY_AFTER_S)


class Placer:
    """Places requests with one policy and one admission; see the module docstring.

    Raises:
        ValueError: ``policy`` does not read ``book`` (it was made with another book's view).
    """

    def __init__(self, book: PlacementBook, policy: RoutingPolicy, admission: Admission | None = None,
                 metrics: RouterMetrics | None = None, pool_index: PoolPrefixIndex | None = None):
        if not policy.view.reads(book):
            raise ValueError(f"the {policy.name} policy reads another PlacementBook than this placer writes")
        self.book, self.policy, self.pool_index = book, policy, pool_index
        self.admission = admission or Admission()  # default: no SLO, admits everything
        self.metrics = metrics or RouterMetrics()

    async def routing_request(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                              workers: Sequence[WorkerInfo]) -> RoutingRequest:
        """The request as policies see it: block hashes and the pool-cached prefix (0 when the
        index cannot be read: a routing hint, never a reason to fail)."""
        fingerprint, block_size = kv_spec_of(workers)
        hashes = tuple(prompt_block_hashes(prompt_token_ids, block_size))
        num_blocks = 0
        if self.pool_index is not None and fingerprint:
            try:
                num_blocks = await self.pool_index.num_cached_blocks(fingerprint, hashes)
            except Exception:  # Redis down: route without the pool's view
                log.warning("cannot read the pool's prefix index", exc_info=True, extra={"request_id": request_id})
        return RoutingRequest(request_id, prompt_token_ids, max_tokens, block_size, hashes, num_blocks * block_size)

    async def place(self, request_id: str, prompt_token_ids: Sequence[int], max_tokens: int,
                    prefill_workers: Sequence[WorkerInfo], decode_workers: Sequence[WorkerInfo]) -> Placement:
        """Chooses where the request runs and admits it. Mutates: the local prefix view (of the
        worker that prefills), the pending prefill tokens (until ``first_token`` or ``finished``)
        and, disaggregated, the request awaiting its decode worker (until ``decoding`` or
        ``finished``). The returned placement carries the prompt's block hashes.

        Raises:
            RouterError: NO_WORKER without a decode worker; SLO_UNATTAINABLE (429 with
                ``retry_after_s``) when admission refuses.
        """
        require_workers("decode", decode_workers)
        request = await self.routing_request(request_id, prompt_token_ids, max_tokens, [*prefill_workers, *decode_workers])
        placement = self.policy.place(prefill_workers, decode_workers, request)
        placement = dataclasses.replace(placement, block_hashes=request.block_hashes)
        self.admission.check(placement, request_id)
        prefilling = placement.prefill or placement.decode
        cached = placement.prediction.num_cached_tokens if placement.prediction else request.num_pool_cached_tokens
        self.book.add_pending(placement, prefilling.address, max(0, request.num_prompt_tokens - cached))
        if placement.prefill is not None:  # its decode worker sees it only when the Decode stream opens
            self.book.add_awaiting_decode(placement, placement.decode.address)
        # Only the worker that computes the prompt holds it for sure. A disaggregated decode
        # worker gets the prompt's KV only with a Decode stream (``decoding``): none follows a
        # request that ends at its first token.
        self.book.record_sent(prefilling.address, request.block_hashes)
        self.metrics.placed(placement.policy, placement.mode)
        prediction = placement.prediction
        log.info("placed %s: prefill %s, decode %s, %d of %d prompt tokens cached, predicted TTFT %s",
                 placement.mode, placement.prefill.worker_id if placement.prefill else "-",
                 placement.decode.worker_id, cached, request.num_prompt_tokens,
                 f"{prediction.ttft_s:.3f} s" if prediction else "n/a", extra={"request_id": request_id})
        return placement

    def choose(self, role: str, workers: Sequence[WorkerInfo], request_id: str, prompt_token_ids: Sequence[int],
               planned: WorkerInfo | None = None) -> WorkerInfo:
        """``planned`` (the placement's worker of ``role``) while it is among ``workers`` (live);
        else the policy's choice among them (a retry or a migration).

        Raises:
            RouterError: NO_WORKER when ``workers`` is empty.
        """
        require_workers(role, workers)
        if planned is not None and any(w.address == planned.address for w in workers):
            worker = planned
        else:
            worker = self.policy.choose(workers, RoutingRequest(request_id, prompt_token_ids))
        self.metrics.routed(self.policy.name, role)
        return worker

    def decoding(self, address: str, placement: Placement | None) -> None:
        """A Decode stream that loads or computes the prompt's KV (a manifest, a resumed or a
        colocated request) opens at ``address``: the prompt's blocks join that worker's local
        prefix view, and the request no longer awaits it (the stream counts in flight). Mutates:
        the local prefix view, awaiting decode. A no-op for None."""
        if placement is not None:
            self.book.remove_awaiting_decode(placement)
            self.book.record_sent(address, placement.block_hashes)

    def attempt(self, address: str) -> contextlib.AbstractContextManager[None]:
        """Counts one request in flight at ``address`` (a Prefill RPC or a Decode stream) for the
        ``with`` block. Mutates: the book's in-flight counts."""
        return self.book.track(address)

    def first_token(self, placement: Placement | None, ttft_s: float) -> None:
        """The placement's prefill is done: its tokens leave the queue (mutates the book's pending
        tokens); prediction vs actual goes to the metrics. A no-op for None."""
        if placement is None:
            return
        self.book.remove_pending(placement)
        if placement.prediction is not None:
            self.metrics.ttft_predicted(placement.mode, placement.prediction.ttft_s, ttft_s)

    def finished(self, placement: Placement | None) -> None:
        """The request ended (with or without a first token): its pending prefill tokens and its
        wait for a decode worker, if still counted, end. A no-op for None (never placed)."""
        if placement is not None:
            self.book.remove_pending(placement)
            self.book.remove_awaiting_decode(placement)
