"""The tensor-parallel process group of one worker and the channel rank 0 drives it through.

Two kinds of traffic, as in vLLM: the model's collectives (the row-parallel all-reduce, the LM
head's all-gather) on the default group, NCCL on CUDA and gloo on the CPU; and the control
messages (each step's inputs, KV to load, blocks to pack) as pickled objects on a gloo group, so
they never touch the GPU stream. On the CPU the two are the same gloo group.

Ranks meet through a file in a fresh temporary directory (``torch.distributed``'s file
rendezvous): no port to pick or race for on the machine.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Collectives wait this long for a peer. A rank that dies closes its sockets and its peers fail
# at once; the deadline only bounds a rank that hangs. Idle ranks wait on the control channel
# between requests, so it must outlast any quiet spell.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


class RankFailure(RuntimeError):
    """A collective failed: another rank of the worker died or hung up."""


@dataclass
class CollectiveTimer:
    """Where this rank's time went since the last reset (two ``perf_counter`` calls per
    collective, ~0.1 us each). CPU: the collectives are synchronous, so wall time is their time;
    on CUDA NCCL is asynchronous and this counts only the launch."""

    all_reduce_s: float = 0.0  # the row-parallel all-reduces and the LM head's all-gather
    num_all_reduces: int = 0
    control_s: float = 0.0  # sending / waiting for the step messages
    forward_s: float = 0.0  # whole passes (collectives included), set by the runner
    num_passes: int = 0


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank`` when the worker was given ``device``: ``cuda`` / ``cuda:k`` -> the
    k + rank-th visible GPU; the CPU stays the CPU."""
    if not device.startswith("cuda"):
        return device
    first = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{first + rank}"


class RankGroup:
    """This process's membership of the worker's ``world_size`` ranks (rank 0: the scheduler).

    Not thread-safe: one thread per process calls it (the engine thread on rank 0).
    """

    def __init__(self, rank: int, world_size: int, device: str, control: dist.ProcessGroup | None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._control = control  # None: the default group
        self.timer = CollectiveTimer()

    @classmethod
    def join(cls, rank: int, world_size: int, rendezvous_file: str, device: str) -> RankGroup:
        """Initialises ``torch.distributed`` for this process (blocks until every rank joined).

        ``device``: this rank's device (see :func:`rank_device`); a CUDA device is made current.
        """
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"file://{rendezvous_file}", rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        control = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT) if backend == "nccl" else None
        return cls(rank, world_size, device, control)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` over the ranks, in place; returns it."""
        started = time.perf_counter()
        _all_reduce(x)
        self.timer.all_reduce_s += time.perf_counter() - started
        self.timer.num_all_reduces += 1
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape on all), in rank order."""
        started = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, x)
        except RuntimeError as err:
            raise RankFailure(f"all_gather failed: {err}") from err
        self.timer.all_reduce_s += time.perf_counter() - started
        return parts

    def scatter(self, messages: list | None):
        """Rank 0 sends ``messages[r]`` to each rank r and gets ``messages[0]`` back; the others
        pass None and get theirs. Blocks until rank 0 sends.

        Raises:
            RankFailure: a rank is gone.
        """
        received = [None]
        started = time.perf_counter()
        try:
            dist.scatter_object_list(received, messages, src=0, group=self._control)
        except RuntimeError as err:
            raise RankFailure(f"control scatter failed: {err}") from err
        if self.rank == 0:  # the others' wait is idle time between passes, not cost
            self.timer.control_s += time.perf_counter() - started
        return received[0]

    def gather(self, obj) -> list | None:
        """Every rank's ``obj`` on rank 0, in rank order (None on the others).

        Raises:
            RankFailure: a rank is gone.
        """
        gathered = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(obj, gathered, dst=0, group=self._control)
        except RuntimeError as err:
            raise RankFailure(f"control gather failed: {err}") from err
        return gathered

    def destroy(self) -> None:
        """Leaves the group (after the last collective)."""
        if dist.is_initialized():
            dist.destroy_process_group()


@torch.compiler.disable  # a graph break around the collective rather than a traced one
def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    try:
        dist.all_reduce(x)
    except RuntimeError as err:
        raise RankFailure(f"all_reduce failed: {err}") from err
    return x
