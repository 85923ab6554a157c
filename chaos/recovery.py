"""Throughput before a scenario's faults and how soon it is back after them, from the driver's
token times (chaos.driver.Progress: one time per token received, seconds after the run start).

::

    tokens  ||  ||||||||||||||||        . .  .   ||| |||||||||||||||||
            ^first token       ^first fault     ^last fault's end
            |RAMP_S|<-baseline->|<-- faults -->|<-- search: windows (t - WINDOW_S, t] -->

- **baseline**: the token rate from RAMP_S after the first token to the first fault (tokens in
  that span / its seconds; at least WINDOW_S of tokens, else there is none). The closed loop's
  first seconds are left out: its requests start together (their prefills at once, and on a
  fresh cluster cold caches), so the rate ramps up before it settles. Its **spread**: the rates
  over the WINDOW_S windows ending WINDOW_S into the baseline, then every SPREAD_STEP_S up to
  the last token before the fault, as their standard deviation and their lowest, each a
  fraction of the baseline: the noise a healthy cluster shows under this load.
- **recovery to a fraction f**: seconds from the last fault's end to the first token time ``t``
  at least WINDOW_S after it at which the rate over ``(t - WINDOW_S, t]`` is at least
  ``f x baseline``; WINDOW_S is its floor (the first window wholly after the heal). None: the run
  ended first.

Two fractions are measured: HALF_FRACTION (half the baseline, the campaign's first measure) and
BASELINE_FRACTION, "back to the baseline": within BASELINE_TOLERANCE (10 %) of it. The tolerance
is the baseline's own noise: in a run of the network campaign on a 2-core machine (6 streams in
flight, docs/failover.md) the baselines' 2 s windows had a standard deviation of 2-13 % of the
baseline (median 6 %), their lowest window 79-98 % of it (median 92 %). A healthy window is
seldom more than 10 % under the baseline, so a cluster that is back meets the bar within a
window or two; one still slowed by its fault does not. A window that meets it counts even if
the next one does not: the measure is when the cluster is back, not how flat its rate stays.

The rate also follows the CPU the cluster gets: each result carries the other jobs' CPU
(chaos.cpu_meter) over the baseline and over the AFTER_HEAL_S after the heal, so a recovery
that is late because the machine got busier says so.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import dataclass

from chaos.cpu_meter import mean_cores

WINDOW_S = 2.0
RAMP_S = 2.0
SPREAD_STEP_S = 0.25
HALF_FRACTION = 0.5
BASELINE_TOLERANCE = 0.10
BASELINE_FRACTION = 1.0 - BASELINE_TOLERANCE
AFTER_HEAL_S = 10.0  # the network campaign's target for the recovery


@dataclass(frozen=True)
class Recovery:
    """A scenario's throughput around its faults (None where there is no such value: no fault,
    under WINDOW_S of tokens before the first, or the run ended before the rate came back)."""

    baseline_tokens_per_s: float | None = None
    baseline_spread: float | None = None  # std dev of the baseline's windowed rates / baseline
    baseline_lowest: float | None = None  # its lowest windowed rate / baseline
    to_half_s: float | None = None  # seconds after the heal until >= HALF_FRACTION x baseline
    to_baseline_s: float | None = None  # seconds after the heal until >= BASELINE_FRACTION x baseline
    # the machine's other jobs, in cores (chaos.cpu_meter): during the baseline, and the
    # AFTER_HEAL_S after the heal (None: not measured)
    other_cores_baseline: float | None = None
    other_cores_after_heal: float | None = None


def window_rate(times_s: list[float], end_s: float) -> float:
    """Tokens per second over ``(end_s - WINDOW_S, end_s]``; ``times_s`` sorted."""
    return (bisect.bisect_right(times_s, end_s) - bisect.bisect_right(times_s, end_s - WINDOW_S)) / WINDOW_S


def baseline_window_rates(times_s: list[float], first_fault_s: float) -> list[float]:
    """The rates over the windows ending WINDOW_S into the baseline (RAMP_S after the first
    token), then every SPREAD_STEP_S, up to the last token before ``first_fault_s`` (empty:
    under WINDOW_S of baseline)."""
    before = bisect.bisect_left(times_s, first_fault_s)
    if not before:
        return []
    rates, k = [], 0
    while (end_s := times_s[0] + RAMP_S + WINDOW_S + k * SPREAD_STEP_S) <= times_s[before - 1]:
        rates.append(window_rate(times_s, end_s))
        k += 1
    return rates


def recovered_after_s(times_s: list[float], heal_s: float, rate_per_s: float) -> float | None:
    """Seconds from ``heal_s`` to the first token time at least WINDOW_S after it whose window's
    rate is at least ``rate_per_s`` (None: none is)."""
    for t in times_s[bisect.bisect_left(times_s, heal_s + WINDOW_S):]:
        if window_rate(times_s, t) >= rate_per_s:
            return t - heal_s
    return None


def recovery(times_s: list[float], first_fault_s: float | None, heal_s: float | None,
             other_cores: list[tuple[float, float]] = ()) -> Recovery:
    """The baseline before ``first_fault_s`` and the recoveries after ``heal_s`` (run seconds;
    None: no fault) from sorted token times, with the other jobs' CPU (``other_cores``:
    CpuMeter.other_cores) over each; see the module docstring."""
    if first_fault_s is None or heal_s is None:
        return Recovery()
    rates = baseline_window_rates(times_s, first_fault_s)
    if not rates:
        return Recovery()
    start_s = times_s[0] + RAMP_S
    num_tokens = bisect.bisect_left(times_s, first_fault_s) - bisect.bisect_left(times_s, start_s)
    baseline = num_tokens / (first_fault_s - start_s)
    return Recovery(baseline, statistics.pstdev(rates) / baseline, min(rates) / baseline,
                    recovered_after_s(times_s, heal_s, HALF_FRACTION * baseline),
                    recovered_after_s(times_s, heal_s, BASELINE_FRACTION * baseline),
                    mean_cores(list(other_cores), start_s, first_fault_s),
                    mean_cores(list(other_cores), heal_s, heal_s + AFTER_HEAL_S))


def tokens_each_s(times_s: list[float]) -> list[int]:
    """Tokens received in each second of the run, [0, 1), [1, 2), ... up to the last token."""
    counts = [0] * (int(times_s[-1]) + 1 if times_s else 0)
    for t in times_s:
        counts[int(t)] += 1
    return counts
