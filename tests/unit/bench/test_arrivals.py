"""Arrival processes: exact trace scaling, Poisson rate for a seed, duration caps."""

import numpy as np
import pytest

from bench.arrivals import ArrivalConfig, poisson_times_s, send_times_s, trace_times_s


def test_trace_times_are_shifted_and_scaled_exactly():
    assert trace_times_s([3.0, 3.0, 6.0, 12.0], 0.5) == [0.0, 0.0, 1.5, 4.5]


def test_trace_mode_needs_timestamps():
    with pytest.raises(ValueError, match="trace workload"):
        send_times_s(ArrivalConfig("trace"), [0.0, None])


def test_poisson_mean_rate_within_tolerance_and_reproducible():
    times = poisson_times_s(20000, rate_per_s=4.0, seed=3)
    gaps = np.diff([0.0, *times])
    assert len(times) / times[-1] == pytest.approx(4.0, rel=0.03)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    assert times == poisson_times_s(20000, 4.0, seed=3)
    assert times != poisson_times_s(20000, 4.0, seed=4)


def test_duration_cap_keeps_the_schedule_prefix():
    config = ArrivalConfig("trace", time_scale=2.0, duration_s=5.0)
    assert send_times_s(config, [0.0, 1.0, 2.0, 3.0, 10.0]) == [0.0, 2.0, 4.0]


def test_concurrency_has_no_schedule_and_bad_values_are_refused():
    assert send_times_s(ArrivalConfig("concurrency", concurrency=4), [None] * 3) is None
    with pytest.raises(ValueError, match="unknown arrival mode 'burst'"):
        ArrivalConfig("burst")
    with pytest.raises(ValueError, match="concurrency >= 1"):
        ArrivalConfig("concurrency", concurrency=0)
