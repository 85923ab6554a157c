"""When waiting requests may join the batch: continuous (Orca) or static batching."""

from __future__ import annotations

from typing import Protocol

from core.request import Request


class BatchingPolicy(Protocol):
    name: str
    # Admit every waiting request that fits at once, even past this step's token budget.
    admits_whole_batch: bool

    def admission_open(self, running: list[Request]) -> bool:
        """True when waiting requests may be admitted at this step."""
        ...


class ContinuousBatching:
    """Iteration-level scheduling (Orca, OSDI'22): requests join at every step."""

    name = "continuous"
    admits_whole_batch = False

    def admission_open(self, running: list[Request]) -> bool:
        return True


class StaticBatching:
    """Request-level batching: a new batch starts only once every request of the previous one
    finished, so finished slots stay idle until the longest request ends (the baseline that
    continuous batching improves on)."""

    name = "static"
    admits_whole_batch = True

    def admission_open(self, running: list[Request]) -> bool:
        return not running


def make_batching_policy(name: str) -> BatchingPolicy:
    """Raises ValueError for an unknown name."""
    policies = {p.name: p for p in (ContinuousBatching, StaticBatching)}
    if name not in policies:
        raise ValueError(f"scheduling policy must be one of {sorted(policies)}, got {name!r}")
    return policies[name]()
