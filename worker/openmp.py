"""How long a worker's idle OpenMP threads spin before they sleep; set before torch loads.

torch's CPU wheels run their parallel regions on GNU OpenMP, which lets a team thread that
finished its share spin for the next region 300,000 times (``GOMP_SPINCOUNT``'s default while
``OMP_WAIT_POLICY`` is unset) before it sleeps: milliseconds of a core per wait (``pause`` takes
tens to ~150 cycles, by CPU). On cores of its own that only burns power; beside any other busy
process it is the pass. A thread that spins keeps its core while its team mate, descheduled for the
other process, holds the barrier, so each of a decode pass's hundreds of regions waits out a
scheduler time slice. Measured on a 2-core Xeon (docs/engine.md, "OpenMP waits"): one other busy
process made a colocated worker's batch-1 TBT 26 -> 760-930 ms, with 92 % of the worker's CPU
time in libgomp's spin; no spin (``OMP_WAIT_POLICY=PASSIVE``) kept it at 46 ms but put every
wait through a futex; 10,000 spins (a fraction of a millisecond) still cover the microseconds
between two operators of a pass.

A worker calls :func:`bound_openmp_spin` as its package loads (``prefill_worker``,
``decode_worker``), before anything imports torch; the runtime reads the variable once, as it
loads. A user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` is left as it is.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SPIN_COUNT = 10_000  # GOMP_SPINCOUNT: cpu-relax iterations before an idle OpenMP thread sleeps
USER_CHOICES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def bound_openmp_spin(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Sets ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` unless ``environ`` already chooses the wait
    (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set). Effective only before torch is imported;
    child processes (tensor-parallel ranks) inherit it. Mutates: ``environ``. Returns whether it
    set the variable."""
    if any(name in environ for name in USER_CHOICES):
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
