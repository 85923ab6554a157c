"""A worker's live load: what its heartbeat publishes and the router places by (docs/design.md §6).

One typed value from the engine to the router: ``LLMEngine.stats()`` builds it, the worker's
heartbeat writes it into its registry entry (:meth:`WorkerLoad.to_wire`), the router parses it
once per registry read (:meth:`WorkerLoad.from_wire`, cost model included) and reads fields, and
the workers' GetStats reply is converted from it (core.proto_convert.worker_stats_to_proto).

Wire format (the registry entry's ``"load"`` object, a flat JSON object of numbers) is version
:data:`LOAD_VERSION`, written beside it as the entry's ``"load_version"``. Version 1 is the
layout workers wrote before the version existed, so an entry without one reads as 1. A router
that meets another version refuses the entry with a ValueError naming both versions (the
registry logs it and skips the worker) rather than guessing at renamed keys and misrouting.
Within one version, keys are only ever added: unknown keys are ignored, missing ones take the
defaults below (an older worker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from core.cost_model import CostModel

LOAD_VERSION = 1
COST_PREFIX = "cost_"  # the cost model's keys on the wire: cost_base_s, cost_per_token_s, ...
_COST_KEYS = tuple(f.name for f in fields(CostModel))


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load at its last stats snapshot. Counts are whole numbers.

    ``num_free_blocks`` and ``max_num_seqs`` are None when not reported (a heartbeat without
    them): the router then does not check free blocks or batch slots. ``cost_model`` always
    exists; ``num_samples`` 0 means nothing was measured yet (see :attr:`fitted_cost_model`).
    """

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    num_total_blocks: int = 0
    num_used_blocks: int = 0
    num_free_blocks: int | None = None
    num_preemptions: int = 0  # since the worker started
    num_batched_tokens: int = 0  # tokens the last pass computed (0 when idle)
    # Prompt tokens still to compute: waiting requests (less the KV they bring) and running
    # ones still prefilling; the queue's prefill work.
    num_waiting_tokens: int = 0
    num_kv_tokens: int = 0  # tokens whose KV the running requests hold (decode attention work)
    recent_step_time_s: float = 0.0  # mean wall time of the last ~16 passes (0 before any)
    max_num_seqs: int | None = None  # the batch-size limit
    cost_model: CostModel = CostModel()  # fitted step times, budget and KV-load bandwidth

    @property
    def num_requests(self) -> int:
        """Running + waiting."""
        return self.num_requests_running + self.num_requests_waiting

    @property
    def fitted_cost_model(self) -> CostModel | None:
        """The cost model when at least one step was measured, else None (count load instead)."""
        return self.cost_model if self.cost_model.num_samples else None

    def to_wire(self) -> dict[str, float]:
        """The heartbeat's ``"load"`` object (version :data:`LOAD_VERSION`); None fields are left out."""
        wire: dict[str, float] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "cost_model" and value is not None:
                wire[f.name] = value
        cost = self.cost_model
        wire.update({f"{COST_PREFIX}{name}": float(getattr(cost, name)) for name in _COST_KEYS})
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, float], version: int = LOAD_VERSION) -> WorkerLoad:
        """Parses a heartbeat's ``"load"`` object written in ``version``.

        Raises:
            ValueError: ``version`` is not :data:`LOAD_VERSION` (a router and a worker of
                different releases), or a value is not a number.
        """
        if version != LOAD_VERSION:
            raise ValueError(f"load version {version!r} is not the {LOAD_VERSION} this build reads: "
                             "run the router and the workers from the same release")
        if not isinstance(wire, Mapping):
            raise ValueError(f"bad worker load {wire!r}: not a JSON object")
        try:
            values = {f.name: _number(wire[f.name], f.type) for f in fields(cls) if f.name in wire}
            cost = {name: _number(wire[f"{COST_PREFIX}{name}"], CostModel.__dataclass_fields__[name].type)
                    for name in _COST_KEYS if f"{COST_PREFIX}{name}" in wire}
        except (TypeError, ValueError) as err:
            raise ValueError(f"bad worker load {dict(wire)!r}: {err}") from None
        if not cost.get("max_num_batched_tokens"):  # absent or 0 (an older worker): the default
            cost.pop("max_num_batched_tokens", None)
        return cls(**values, cost_model=CostModel(**cost))


def _number(value: object, annotation: str) -> int | float:
    """``value`` as the field's type (the annotation's text: dataclass fields are strings here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{value!r} is not a number")
    return float(value) if annotation.startswith("float") else int(value)
