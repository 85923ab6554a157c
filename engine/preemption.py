"""PreemptionPolicy: which running request gives its blocks up, and how it comes back (docs/design.md §7).

When a running request cannot get a block the scheduler preempts the *youngest* running request
(the last admitted; vLLM's choice: it has the least work to lose and FCFS order is kept) and
frees its blocks. Its KV is then either *swapped* out (packed by the engine into a swap space and
loaded back on re-admission) or *recomputed* from prompt + tokens so far; the output is identical
either way.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from core.request import Request


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


class PreemptionPolicy:
    """``mode``: "swap" or "recompute" (EngineConfig.preemption_mode); swap falls back to
    recompute for a request with no KV computed yet (nothing to save).

    Raises:
        ValueError: an unknown mode.
    """

    def __init__(self, mode: str = "recompute"):
        self.mode = PreemptionMode(mode)

    def victim(self, running: Sequence[Request]) -> Request:
        """The request to preempt: the last of ``running`` (admission order). ``running`` must
        not be empty. Reads only."""
        return running[-1]

    def mode_for(self, request: Request) -> PreemptionMode:
        """How ``request`` gives its blocks up. Reads only."""
        if self.mode is PreemptionMode.SWAP and request.num_computed_tokens:
            return PreemptionMode.SWAP
        return PreemptionMode.RECOMPUTE
