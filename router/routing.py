"""Routing policies: which live worker of a role gets a request.

A policy is an object behind :class:`RoutingPolicy`; :class:`LeastLoadedPolicy` is the first.
Prefix-aware and SLO-aware policies (DESIGN.md §2) plug in beside it.
"""

from __future__ import annotations

import abc
import contextlib
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from core.registry import WorkerInfo


@dataclass(frozen=True)
class RoutingRequest:
    """What a policy may look at: the request's identity and prompt."""

    request_id: str
    prompt_token_ids: Sequence[int]


class InFlightCounter:
    """This router's own requests in flight per worker address.

    A worker's heartbeat is up to a second old; counting our own placements since then keeps a
    burst of requests from all landing on the worker that looked idle.
    """

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()

    def get(self, address: str) -> int:
        return self._counts[address]

    @contextlib.contextmanager
    def track(self, address: str) -> Iterator[None]:
        """Counts one request at ``address`` for the duration of the ``with`` block."""
        self._counts[address] += 1
        try:
            yield
        finally:
            self._counts[address] -= 1
            if self._counts[address] <= 0:
                del self._counts[address]


class RoutingPolicy(abc.ABC):
    """Chooses one worker for a request."""

    name: str = "abstract"

    @abc.abstractmethod
    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        """Returns one of ``workers``.

        Raises:
            ValueError: ``workers`` is empty (the caller reports "no healthy worker").
        """


class LeastLoadedPolicy(RoutingPolicy):
    """The worker with the fewest requests: running + waiting (its last heartbeat) plus this
    router's own in-flight requests to it. Ties go to the most free KV blocks, then worker_id."""

    name = "least_loaded"

    def __init__(self, in_flight: InFlightCounter):
        self.in_flight = in_flight

    def load(self, worker: WorkerInfo) -> float:
        stats = worker.load
        return (
            stats.get("num_requests_running", 0)
            + stats.get("num_requests_waiting", 0)
            + self.in_flight.get(worker.address)
        )

    def choose(self, workers: Sequence[WorkerInfo], request: RoutingRequest) -> WorkerInfo:
        if not workers:
            raise ValueError(f"no worker to route request {request.request_id!r} to")
        return min(workers, key=lambda w: (self.load(w), -w.load.get("num_free_blocks", 0), w.worker_id))
