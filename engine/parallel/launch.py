"""Starts a worker's tensor-parallel ranks and takes the worker down when one dies.

The worker process is rank 0 (scheduler, pool I/O, gRPC); ranks 1..N-1 are child processes
(``multiprocessing`` spawn) that build their runner with the function rank 0 passes
(:func:`engine.parallel.build.build_rank_runner`: it loads their shard) and run
:func:`engine.parallel.runner.serve_rank`.
A rank that dies ends the worker: rank 0 watches every child's exit (:class:`RankProcesses`),
and a collective that fails raises RankFailure on the survivors; children get SIGKILL when the
thread that started them ends (PR_SET_PDEATHSIG: the worker's engine thread, and so its process),
so a worker never leaves ranks behind. Stop them (RankProcesses.stop) on that same thread.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.parallel.group import RankGroup, rank_device
from engine.model_runner import ModelRunner
from engine.parallel.runner import STOP, StepMessage, serve_rank

log = logging.getLogger(__name__)

# Builds a rank's runner over its shard, in the rank's process; a module-level function, so that
# spawn can pass it to the child by name.
BuildRunner = Callable[[EngineConfig, RankGroup], ModelRunner]

_PR_SET_PDEATHSIG = 1


class RankProcesses:
    """Ranks 1..N-1 of one worker as child processes. ``on_exit(rank, exitcode)`` runs (on a
    watcher thread) when one exits before :meth:`stop`."""

    def __init__(self, processes: list[multiprocessing.Process], rendezvous_dir: Path):
        self.processes = processes
        self._dir = rendezvous_dir
        self._stopping = threading.Event()
        self.exited: tuple[int, int | None] | None = None  # (rank, exit code) of the first to die

    def watch(self, on_exit: Callable[[int, int | None], None]) -> threading.Thread:
        """Starts the watcher thread; returns it."""

        def run() -> None:
            sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
            ready = multiprocessing.connection.wait(list(sentinels))
            if self._stopping.is_set():
                return
            rank = sentinels[ready[0]]
            self.exited = (rank, self.processes[rank - 1].exitcode)
            log.error("tensor-parallel rank %d exited with code %s: the worker goes down", *self.exited)
            on_exit(*self.exited)

        thread = threading.Thread(target=run, name="tp-watch", daemon=True)
        thread.start()
        return thread

    @property
    def all_alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def stop(self, group: RankGroup, timeout_s: float = 10.0) -> None:
        """Sends STOP (when every rank still lives), joins the ranks, kills any left after
        ``timeout_s``, removes the rendezvous directory. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if self.all_alive:
            try:
                group.scatter([StepMessage(STOP)] * group.world_size)
            except RuntimeError:
                log.warning("could not send STOP to the tensor-parallel ranks")
        for process in self.processes:
            process.join(timeout_s)
            if process.is_alive():
                process.kill()
                process.join()
        group.destroy()
        shutil.rmtree(self._dir, ignore_errors=True)


def start_ranks(config: EngineConfig, build_runner: BuildRunner) -> tuple[RankGroup, RankProcesses]:
    """Spawns ranks 1..N-1 of ``config.tensor_parallel_size`` and joins the group as rank 0
    (blocks until every rank joined). Each child builds its runner with ``build_runner`` (it
    loads its shard itself).

    Raises:
        RuntimeError: a rank died before the group formed.
    """
    tp = config.tensor_parallel_size
    rendezvous_dir = Path(tempfile.mkdtemp(prefix="tandem-tp-"))
    rendezvous = str(rendezvous_dir / "rendezvous")
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=rank_main, args=(rank, config, rendezvous, build_runner),
                                 name=f"tp-rank-{rank}", daemon=True) for rank in range(1, tp)]
    for process in processes:
        process.start()
    group = RankGroup.join(0, tp, rendezvous, rank_device(config.device, 0))
    return group, RankProcesses(processes, rendezvous_dir)


def rank_main(rank: int, config: EngineConfig, rendezvous: str, build_runner: BuildRunner) -> None:
    """Entry point of rank ``rank`` > 0: joins the group, builds its runner, serves rank 0."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when this rank stops
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    group = RankGroup.join(rank, config.tensor_parallel_size, rendezvous, rank_device(config.device, rank))
    runner = build_runner(config, group)
    serve_rank(runner, group)
    group.destroy()


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the watcher and the collectives still end the ranks
        pass
