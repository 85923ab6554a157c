"""chaos.recovery on synthetic token times: the baseline before a fault (from RAMP_S = 2 s after
the first token), its spread, and how soon after the heal the rate is back to half of it and to
it (within BASELINE_TOLERANCE).

Tokens come in decode steps, as a batch of streams yields them: ``steps(start, counts)`` puts
``counts[i]`` tokens at ``start + i * 0.5`` s. Times are multiples of 1/16 s, exact in binary."""

from __future__ import annotations

import statistics

import pytest

from chaos.recovery import (BASELINE_TOLERANCE, Recovery, baseline_window_rates, recovered_after_s, recovery,
                            tokens_each_s)

STEP_S = 0.5


def steps(start_s: float, counts: list[int]) -> list[float]:
    return [start_s + i * STEP_S for i, n in enumerate(counts) for _ in range(n)]


def even(start_s: float, end_s: float, per_s: int) -> list[float]:
    """``per_s`` tokens a second, evenly, from ``start_s`` up to (not at) ``end_s``."""
    return [start_s + i / per_s for i in range(int((end_s - start_s) * per_s))]


def test_the_tolerance_is_a_bar_between_the_baseline_and_half_of_it():
    """Back to the baseline must be stricter than back to half of it, and let through the rate
    of the noisy test below (15/16 of its baseline)."""
    assert 1 / 16 <= BASELINE_TOLERANCE < 0.5


def test_recovery_at_a_known_time():
    # 16 tokens/s for 6 s (8 every 0.5 s), nothing from the fault (6-8 s) until 9.5 s, then the
    # full rate again
    times = steps(0.0, [8] * 12) + steps(9.5, [8] * 8)
    result = recovery(times, first_fault_s=6.0, heal_s=8.0)
    assert result.baseline_tokens_per_s == 16.0  # 8 steps of 8 tokens from 2 s to the fault
    assert (result.baseline_spread, result.baseline_lowest) == (0.0, 1.0)
    # the first window wholly after the heal, (8, 10], holds the steps at 9.5 and 10.0: 16 tokens,
    # 8/s, half the baseline; (8.5, 10.5] 24 (75 %); (9, 11] 32, the baseline
    assert result.to_half_s == 2.0
    assert result.to_baseline_s == 3.0


def test_no_recovery_within_the_run():
    # back at 12 tokens/s after the heal (16/s less every 4th token), 75 % of the baseline: half
    # of it, never the baseline
    times = even(0.0, 6.0, 16) + [8 + k / 16 for k in range(144) if k % 4 != 3]
    result = recovery(times, first_fault_s=6.0, heal_s=8.0)
    assert result == Recovery(16.0, 0.0, 1.0, to_half_s=2.0, to_baseline_s=None)
    # nothing at all after the heal: neither
    assert recovery(even(0.0, 6.0, 16), 6.0, 8.0) == Recovery(16.0, 0.0, 1.0, None, None)


def test_no_baseline_no_recovery():
    times = even(0.0, 4.0, 16) + even(6.0, 12.0, 16)
    assert recovery(times, None, None) == Recovery()  # no fault
    # the ramp (2 s) and 1.5 s of baseline before the fault: under a window of it
    assert recovery(times, first_fault_s=3.5, heal_s=5.0) == Recovery()
    assert recovery([], first_fault_s=8.0, heal_s=20.0) == Recovery()  # no token at all
    assert recovery(even(0.5, 6.0, 16), first_fault_s=0.25, heal_s=2.0) == Recovery()  # fault before the first


def test_a_noisy_baseline_is_measured_and_a_window_in_its_noise_counts_as_back():
    # steps of 24, 24, 8, 8, 16, 16 tokens every 0.5 s: 32/s on average, its 2 s windows (4 steps)
    # between 48 and 72 tokens; after the heal a steady 30/s, 15/16 of the baseline
    times = steps(0.0, [24, 24, 8, 8, 16, 16] * 2) + steps(8.0, [15] * 12)
    result = recovery(times, first_fault_s=6.0, heal_s=8.0)
    assert result.baseline_tokens_per_s == 128 / 4.0  # the steps at 2.0 ... 5.5 s
    # windows end at 4.0, 4.25, ..., 5.5 (the last token before the fault): the ones ending at step
    # i (i x 0.5 s) and 0.25 s after it hold steps i-3..i
    by_step = {8: 36.0, 9: 32.0, 10: 28.0, 11: 24.0}
    expected = [rate for i, rate in by_step.items() for _ in range(2 if i < 11 else 1)]
    assert baseline_window_rates(times, 6.0) == expected
    assert result.baseline_spread == pytest.approx(statistics.pstdev(expected) / 32.0, rel=1e-12)
    assert result.baseline_lowest == 24.0 / 32.0
    # (8, 10] holds 4 steps of 15 = 60 tokens = 30/s: back within the tolerance at the floor,
    # never at the baseline's mean itself
    assert (result.to_half_s, result.to_baseline_s) == (2.0, 2.0)
    assert recovered_after_s(times, 8.0, 32.0) is None


def test_the_other_jobs_cpu_over_the_baseline_and_after_the_heal():
    times = even(0.0, 6.0, 16) + even(8.0, 20.0, 16)
    # one sample a second (its interval's end): 0.5 cores until 6 s, then 1.5
    cores = [(float(t), 0.5 if t <= 6 else 1.5) for t in range(1, 21)]
    result = recovery(times, first_fault_s=6.0, heal_s=8.0, other_cores=cores)
    # the baseline (2, 6]: 3, 4, 5, 6 at 0.5; after the heal (8, 18]: 9 ... 18 at 1.5
    assert (result.other_cores_baseline, result.other_cores_after_heal) == (0.5, 1.5)
    assert recovery(times, 6.0, 8.0).other_cores_baseline is None  # not measured


def test_recovered_after_is_the_first_window_wholly_after_the_heal_at_the_rate():
    times = even(0.0, 10.0, 16)  # no dip at all: the floor is the window
    assert recovered_after_s(times, 3.0, 16.0) == 2.0
    assert recovered_after_s(times, 3.03125, 16.0) == 5.0625 - 3.03125  # at the first token 2 s after the heal
    assert recovered_after_s(times, 3.0, 16.5) is None


def test_tokens_each_second():
    assert tokens_each_s([0.0, 0.5, 0.99, 2.0, 2.5]) == [3, 0, 2]
    assert tokens_each_s([]) == []
