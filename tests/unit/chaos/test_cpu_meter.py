"""chaos.cpu_meter from fake /proc files: the machine's busy time, a process's CPU time, and the
other jobs' cores between two samples (ours left out, a restarted service's new pid counted)."""

from __future__ import annotations

import itertools

from chaos.cpu_meter import CLOCK_TICKS_PER_S, CpuMeter, machine_busy_s, mean_cores, process_cpu_s

T = CLOCK_TICKS_PER_S  # ticks in a second


def proc_stat(busy_ticks: int, idle_ticks: int) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice; busy split over user,
    # system and steal, idle over idle and iowait; guest (inside user) must not count twice
    user, system = busy_ticks // 2, busy_ticks // 4
    steal = busy_ticks - user - system
    return (f"cpu  {user} 0 {system} {idle_ticks - 7} 7 0 0 {steal} {user} 0\n"
            f"cpu0 {user} 0 {system} {idle_ticks - 7} 7 0 0 {steal} 0 0\nintr 1 2 3\n")


def pid_stat(pid: int, utime_ticks: int, stime_ticks: int) -> str:
    # the command name may hold spaces and parentheses: fields are counted after the last ')'
    return f"{pid} (python -m (x) y) S 1 2 3 0 -1 4194560 100 0 0 0 {utime_ticks} {stime_ticks} 0 0 20 0 4 0 99 1 2\n"


def test_parsers():
    assert machine_busy_s(proc_stat(3 * T, 5 * T)) == 3.0
    assert process_cpu_s(pid_stat(42, 2 * T, T)) == 3.0


def test_the_other_jobs_cores_leave_out_ours_and_count_a_new_pid_whole(monkeypatch):
    files = {}
    clock = itertools.count(10.0, 1.0)
    walls = iter([100.0, 102.0, 104.0])
    monkeypatch.setattr("chaos.cpu_meter.time.monotonic", lambda: next(walls))
    pids = [[7, 8], [7, 8], [7, 9]]  # service 8 restarted as 9 before the third take
    meter = CpuMeter(lambda: pids.pop(0), lambda: next(clock), read=files.__getitem__)

    files.update({"/proc/stat": proc_stat(10 * T, 0), "/proc/7/stat": pid_stat(7, T, 0),
                  "/proc/8/stat": pid_stat(8, T, 0)})
    meter.take()
    assert meter.other_cores == []  # the first take only starts an interval
    # 2 s later: the machine busy 3 s more, of which ours 1 s (7) + 0.5 s (8): others 1.5 s / 2 s
    files.update({"/proc/stat": proc_stat(13 * T, 0), "/proc/7/stat": pid_stat(7, 2 * T, 0),
                  "/proc/8/stat": pid_stat(8, T, T // 2)})
    meter.take()
    assert meter.other_cores == [(10.0, 0.75)]
    # 2 s later: busy 4 s more; 7 used 1 s, the new 9 has used 1 s in all (counted whole), 8 is gone
    files.update({"/proc/stat": proc_stat(17 * T, 0), "/proc/7/stat": pid_stat(7, 3 * T, 0),
                  "/proc/9/stat": pid_stat(9, 0, T)})
    meter.take()
    assert meter.other_cores == [(10.0, 0.75), (11.0, 1.0)]


def test_a_process_that_cannot_be_read_is_skipped(monkeypatch):
    walls = iter([0.0, 1.0])
    monkeypatch.setattr("chaos.cpu_meter.time.monotonic", lambda: next(walls))

    def read(path: str) -> str:
        if path == "/proc/5/stat":
            raise FileNotFoundError(path)  # it exited between listing and reading
        return files[path]

    files = {"/proc/stat": proc_stat(0, 0), "/proc/6/stat": "6 (half a line"}
    meter = CpuMeter(lambda: [5, 6], lambda: 3.0, read=read)
    meter.take()
    files["/proc/stat"] = proc_stat(T, 0)
    meter.take()
    assert meter.other_cores == [(3.0, 1.0)]


def test_mean_cores_over_the_intervals_ending_in_a_span():
    samples = [(1.0, 0.5), (2.0, 1.0), (3.0, 1.5), (4.0, 2.0)]
    assert mean_cores(samples, 1.0, 3.0) == 1.25  # the ones ending at 2.0 and 3.0
    assert mean_cores(samples, 4.0, 9.0) is None
