"""How much CPU the machine's other jobs took while a scenario ran (Linux /proc).

On a small machine shared with other work the cluster's token rate follows the CPU it gets: a
job that starts beside it slows it as surely as a fault does (in a network campaign run on 2
cores, the other jobs going from 0.8 to 1.5 cores halved the token rate after a heal;
docs/failover.md). Every ``every_s`` the meter reads the machine's busy CPU time (/proc/stat: every
state but idle and iowait; steal, the hypervisor's, included) and that of the cluster's
processes and of this one (the driver and the link proxies; /proc/PID/stat utime + stime). The
difference, in cores over the interval, is the other jobs': chaos.recovery compares it before
the faults and after the heal.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def machine_busy_s(proc_stat: str) -> float:
    """CPU seconds the machine was busy since boot, all cores, from /proc/stat's ``cpu`` line
    (user nice system idle iowait irq softirq steal; guest time is inside user)."""
    fields = [int(v) for v in proc_stat.split("\n", 1)[0].split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / CLOCK_TICKS_PER_S


def process_cpu_s(pid_stat: str) -> float:
    """CPU seconds (user + system) of one process from its /proc/PID/stat (the fields after the
    command name, which may hold spaces and parentheses)."""
    fields = pid_stat[pid_stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS_PER_S


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class CpuMeter:
    """Samples the other jobs' CPU into :attr:`other_cores`: (seconds on ``clock`` at the end of
    an interval, cores the other jobs used over it), one per :meth:`take` after the first.

    Args:
        pids: the processes that are ours (asked at every take: supervision restarts services
            under new pids; a pid first seen counts its whole CPU time, a pid gone its last
            interval not at all).
        clock: the run's seconds (the driver's ``Progress.now_s``), to align with token times.
        read: reads a /proc file (tests pass fakes).
    """

    def __init__(self, pids: Callable[[], list[int]], clock: Callable[[], float], every_s: float = 1.0,
                 read: Callable[[str], str] = _read):
        self.pids, self.clock, self.every_s, self.read = pids, clock, every_s, read
        self.other_cores: list[tuple[float, float]] = []
        self._last: tuple[float, float, dict[int, float]] | None = None  # wall s, machine busy s, cpu s by pid

    def take(self) -> None:
        """Reads /proc once; appends the interval since the previous take (mutates other_cores)."""
        now_s, busy_s = time.monotonic(), machine_busy_s(self.read("/proc/stat"))
        ours: dict[int, float] = {}
        for pid in self.pids():
            try:
                ours[pid] = process_cpu_s(self.read(f"/proc/{pid}/stat"))
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
        if self._last is not None:
            last_s, last_busy_s, last_ours = self._last
            ours_s = sum(cpu_s - last_ours.get(pid, 0.0) for pid, cpu_s in ours.items())
            elapsed_s = now_s - last_s
            if elapsed_s > 0:
                self.other_cores.append((self.clock(), max(0.0, busy_s - last_busy_s - ours_s) / elapsed_s))
        self._last = (now_s, busy_s, ours)

    async def run(self) -> None:
        """Takes a sample every ``every_s`` until cancelled."""
        while True:
            self.take()
            await asyncio.sleep(self.every_s)


def mean_cores(samples: list[tuple[float, float]], start_s: float, end_s: float) -> float | None:
    """The mean of the samples whose interval ends within ``(start_s, end_s]`` (None: none does)."""
    values = [cores for t_s, cores in samples if start_s < t_s <= end_s]
    return sum(values) / len(values) if values else None
