"""The soak sampler's reduction from hand-made samples: first / last / max and the RSS slope."""

from __future__ import annotations

import pytest

from chaos.sampler import MIB, Sample, plot, summary
from chaos.schedule import parse_campaign


def samples(rss_mib: list[float], leases: list[int]) -> list[Sample]:
    return [Sample(t_s=60.0 * i, rss_bytes={"router": int(r * MIB)}, gauges={"kv_pool.num_leases": n},
                   ended={"completed": 10 * i}, num_tokens=100 * i)
            for i, (r, n) in enumerate(zip(rss_mib, leases))]


def test_summary_is_first_last_max_and_the_second_half_rss_slope():
    # 0..6 minutes; the second half (t >= 180 s) grows 2 MiB a minute = 120 MiB/h
    got = summary(samples([100, 150, 150, 150, 152, 154, 156], [0, 3, 5, 2, 1, 4, 0]))
    assert got["rss_mib.router"] == {"first": 100.0, "last": 156.0, "max": 156.0, "slope_mib_per_h": 120.0}
    assert got["kv_pool.num_leases"] == {"first": 0, "last": 0, "max": 5}


def test_a_flat_rss_has_slope_zero_and_too_few_points_have_none():
    assert summary(samples([80] * 6, [0] * 6))["rss_mib.router"]["slope_mib_per_h"] == 0.0
    assert summary(samples([80, 90], [0, 0]))["rss_mib.router"]["slope_mib_per_h"] is None
    assert summary([]) == {}


def test_the_plot_is_written(tmp_path):
    path = tmp_path / "samples.png"
    plot(samples([100, 101, 102], [0, 1, 0]), path, "soak")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sample_every_s_is_parsed_and_checked():
    base = {"scenarios": [{"name": "soak", "faults": []}]}
    assert parse_campaign({**base, "sample_every_s": 30}).sample_every_s == 30.0
    assert parse_campaign(base).sample_every_s == 0.0
    with pytest.raises(ValueError, match="sample_every_s"):
        parse_campaign({**base, "sample_every_s": -1})


def test_scenario_load_overrides_are_parsed_and_checked():
    data = {"scenarios": [{"name": "capacity", "faults": [], "duration_s": 180},
                          {"name": "soak", "faults": [], "capacity_fraction": 0.8}]}
    capacity, soak = parse_campaign(data).scenarios
    assert (capacity.duration_s, capacity.capacity_fraction) == (180.0, 0.0)
    assert (soak.duration_s, soak.capacity_fraction) == (None, 0.8)
    with pytest.raises(ValueError, match="needs a scenario before it"):
        parse_campaign({"scenarios": [{"name": "soak", "capacity_fraction": 0.8}]})
    with pytest.raises(ValueError, match=r"scenarios\[0\].duration_s must be > 0"):
        parse_campaign({"scenarios": [{"name": "x", "duration_s": 0}]})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['rate'\]"):
        parse_campaign({"scenarios": [{"name": "x", "rate": 1}]})


def test_the_completion_rate_is_completed_over_the_run():
    from chaos.campaign import ScenarioResult

    result = ScenarioResult("capacity", [], {"completed": 45, "sent": 50}, {}, 0.0, 0, None, 180.0)
    assert result.completion_rate_per_s == 0.25
