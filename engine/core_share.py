"""Core sharing: a decode worker runs its passes on the prefill workers' cores while they are idle.

Disaggregated on one machine, ``tandem up`` gives each role cores of its own
(``launcher.commands.worker_threads``: on 2 cores, 1 prefill thread + 1 decode thread), because an
OpenMP team whose threads share a core with another busy process waits at every barrier for the
one that was descheduled. But a prefill worker is busy only while prompts arrive; the rest of
the time its cores sit idle while the decode worker, bound by its own, runs every pass at half the
machine's speed. Here the two roles take turns on the prefill share of the cores, pass by pass:

- an **owner** (each prefill worker) holds the cores while it has requests, from the first until
  its queue is empty; it takes them back between two of the borrower's passes (waiting for at
  most the pass in progress, never more than ``wait_s``);
- a **borrower** (a decode worker) checks before each forward pass: when no owner holds or wants
  the cores, it runs the pass with ``base + extra`` threads (``torch.set_num_threads``), else with
  its own ``base``. One borrower at a time holds them.

So two OpenMP teams never share a core, and the decode worker gets the whole machine whenever
prefill does not need it. This is phase-wise sharing of compute between prefill and decode on one
machine (as semi-PD, Hong et al. 2025, arXiv 2504.19867, does with a GPU's SMs), with the KV
still moving through the pool: the roles stay separate processes and separate failure domains.

Two ``flock(2)`` files in a directory the launcher creates for the cluster coordinate it:

    want    owners hold it shared while they have work; a borrower that cannot take it
            exclusively (non-blocking, released at once) knows an owner wants the cores
    cores   owners hold it shared while they have work, the borrower exclusively while it runs
            passes on them

The kernel drops a dead process's locks, so a worker that crashes or is killed never strands the
cores. A hung borrower holding either lock costs an owner ``wait_s`` (then it runs beside it).
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import REGISTRY, CollectorRegistry, Counter

from core import metric_names as names

log = logging.getLogger(__name__)

ROLES = ("owner", "borrower")
DEFAULT_WAIT_S = 1.0
_POLL_S = 0.0005  # an owner's retry interval while a borrower's pass ends (a pass is ~10-100 ms)


class CoreShareMetrics:
    """``tandem:core_share_passes_total {cores}`` (borrower: passes run on its own cores only, or
    with the borrowed ones too) and ``tandem:core_share_wait_seconds_total`` (owner: time spent
    waiting for a borrower's pass to end) in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        self.passes = Counter(names.CORE_SHARE_PASSES, "Decode passes by whose cores ran them: own, or own + "
                                                       "borrowed from idle prefill workers.", ["cores"],
                              registry=registry)
        self.wait_seconds = Counter(names.CORE_SHARE_WAIT_SECONDS, "Time a prefill worker waited for a decode "
                                                                   "pass on its cores to end.", registry=registry)
        for cores in ("own", "borrowed"):  # both series from the start, at 0
            self.passes.labels(cores)


_process_metrics: CoreShareMetrics | None = None


def process_metrics() -> CoreShareMetrics:
    """The counters of this process, in prometheus_client's default registry."""
    global _process_metrics
    if _process_metrics is None:
        _process_metrics = CoreShareMetrics(REGISTRY)
    return _process_metrics


class CoreShare:
    """One worker's side of the turn-taking on a set of cores (module docstring).

    ``directory``: shared by every worker of the machine (created if missing). ``role``: owner
    (prefill) or borrower (decode). ``base_threads``: the worker's own threads; ``extra_threads``:
    the borrower's extra while it holds the cores (the machine's cores the decode workers do not
    own: launcher.commands.shared_threads; 0 for an owner). ``wait_s``: the longest an owner waits
    for the cores (a borrower's pass in progress, or a borrower frozen in its check).

    Call from the engine thread: :meth:`busy` when the worker has work (before its first pass),
    :meth:`between_passes` after each pass, :meth:`idle` when its queue is empty, :meth:`close`
    at the end.

    Raises:
        ValueError: unknown role, threads below 1 (base) or 0 (extra), an owner with extra
            threads, a borrower without, or wait_s <= 0.
        OSError: the lock files cannot be created.
    """

    def __init__(self, directory: str | os.PathLike, role: str, base_threads: int, extra_threads: int = 0,
                 wait_s: float = DEFAULT_WAIT_S, metrics: CoreShareMetrics | None = None):
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if base_threads < 1:
            raise ValueError(f"base_threads must be >= 1, got {base_threads}")
        if role == "borrower" and extra_threads < 1:
            raise ValueError(f"a borrower needs extra_threads >= 1, got {extra_threads}")
        if role == "owner" and extra_threads != 0:
            raise ValueError(f"an owner takes no extra_threads, got {extra_threads}")
        if not wait_s > 0:
            raise ValueError(f"wait_s must be > 0, got {wait_s!r}")
        self.role, self.base_threads, self.extra_threads, self.wait_s = role, base_threads, extra_threads, wait_s
        self.metrics = metrics or process_metrics()
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self._want = os.open(path / "want", os.O_RDWR | os.O_CREAT, 0o600)
        self._cores = os.open(path / "cores", os.O_RDWR | os.O_CREAT, 0o600)
        self.holding = False  # owner: holds both locks; borrower: holds ``cores`` exclusively
        self._threads: int | None = None  # what this object last set (None: not yet; the first pass sets it)
        self._slow_waits = 0
        # Told the threads each time a borrower changes them (the engine scales its mixed-step
        # prompt tokens by them: engine.scheduler.Scheduler.mixed_prefill_share).
        self.on_threads: Callable[[int], None] | None = None

    @property
    def threads(self) -> int:
        """The threads the worker's next pass runs with."""
        return self.base_threads + self.extra_threads if self.holding and self.role == "borrower" else \
            self.base_threads

    def busy(self) -> None:
        """The worker has work. Owner: takes the cores (see ``wait_s``). Borrower: takes them
        for its first pass if no owner holds or wants them."""
        if self.role == "borrower":
            self._decide()
            return
        if self.holding:
            return
        started = time.perf_counter()
        deadline = started + self.wait_s
        # ``want`` first (a borrower holds it exclusively only for the instant of its check, unless
        # it froze there), then ``cores`` (a borrower holds it for the pass in progress); both
        # within the one deadline
        for lock in (self._want, self._cores):
            if not self._lock_by(lock, deadline):
                break
        self.metrics.wait_seconds.inc(time.perf_counter() - started)
        self.holding = True

    def _lock_by(self, fd: int, deadline: float) -> bool:
        """Owner: ``fd`` locked shared before ``deadline`` (True), or the wait given up, logged."""
        while not _try_lock(fd, fcntl.LOCK_SH):
            if time.perf_counter() >= deadline:  # a hung borrower: run beside it rather than stall
                self._slow_waits += 1
                if self._slow_waits == 1 or self._slow_waits % 100 == 0:
                    log.warning("a decode worker kept this prefill worker's cores past %.1f s (%d times); "
                                "running beside it", self.wait_s, self._slow_waits)
                return False
            time.sleep(_POLL_S)
        return True

    def between_passes(self) -> None:
        """Borrower: a pass ended (counted by the cores it ran on); before the next, gives the
        cores back if an owner wants them, or takes them if none does, and sets torch's threads
        to match. Owner: nothing (it holds them until :meth:`idle`)."""
        if self.role == "owner":
            return
        self.metrics.passes.labels("borrowed" if self.holding else "own").inc()
        self._decide()

    def _decide(self) -> None:
        wanted = self.owner_wants()
        if self.holding and wanted:
            fcntl.flock(self._cores, fcntl.LOCK_UN)
            self.holding = False
        elif not self.holding and not wanted:
            self.holding = _try_lock(self._cores, fcntl.LOCK_EX)
        self._set_threads(self.threads)

    def owner_wants(self) -> bool:
        """Borrower: whether some owner holds or waits for the cores now."""
        if not _try_lock(self._want, fcntl.LOCK_EX):
            return True
        fcntl.flock(self._want, fcntl.LOCK_UN)
        return False

    def idle(self) -> None:
        """The worker's queue is empty: an owner lets the cores go, a borrower gives them back
        (an idle decode worker must not make a prefill worker wait)."""
        if not self.holding:
            return
        fcntl.flock(self._cores, fcntl.LOCK_UN)
        if self.role == "owner":
            fcntl.flock(self._want, fcntl.LOCK_UN)
        self.holding = False
        self._set_threads(self.base_threads)

    def close(self) -> None:
        """Lets everything go; the share cannot be used after."""
        self.idle()
        os.close(self._want)
        os.close(self._cores)

    def _set_threads(self, n: int) -> None:
        if self.role == "borrower" and n != self._threads:
            torch.set_num_threads(n)
            self._threads = n
            if self.on_threads is not None:
                self.on_threads(n)


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True
