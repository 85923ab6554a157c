"""Metric math on hand-computed records."""

import math

import pytest

from bench.client import RequestRecord
from bench.metrics import SLO, percentile, request_tbt_s, summarize


def rec(index, ttft_s, gaps_s, *, tokens=None, error_kind="", prompt_tokens=10):
    times = [ttft_s]
    for g in gaps_s:
        times.append(times[-1] + g)
    return RequestRecord(index, start_s=0.0, ttft_s=ttft_s, chunk_times_s=times, e2e_s=times[-1],
                         prompt_tokens=prompt_tokens, output_tokens=tokens or len(times), finish_reason="length",
                         error_kind=error_kind)


def test_percentile_interpolates_linearly():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 90) == 46.0  # rank 3.6: 40 + 0.6 x 10
    assert percentile([7], 99) == 7
    assert math.isnan(percentile([], 50))


def test_request_tbt_is_the_p90_of_its_gaps():
    # gaps 0.1 x 9 and 1.0: p90 at rank 8.1 -> 0.1 + 0.1 x 0.9 = 0.19
    r = rec(0, 0.5, [0.1] * 9 + [1.0])
    assert request_tbt_s(r) == pytest.approx(0.19)
    assert request_tbt_s(rec(1, 0.5, [])) == 0.0


def test_goodput_counts_requests_meeting_both_slos():
    records = [
        rec(0, 0.5, [0.05, 0.05]),  # good
        rec(1, 1.5, [0.05, 0.05]),  # TTFT 1500 > 1000
        rec(2, 0.2, [0.3, 0.3]),  # TBT 300 > 100
        rec(3, 0.9, []),  # one chunk: no gaps, TTFT ok -> good
        rec(4, 0.1, [0.01], error_kind="http_503"),  # errors never count
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=1000, tbt_ms=100))
    assert s["goodput_rps"] == 1.0  # 2 good / 2 s
    assert s["slo_attainment"] == 0.4  # 2 of 5 sent
    assert s["num_ok"] == 4 and s["errors_by_kind"] == {"http_503": 1}
    assert s["request_throughput_rps"] == 2.0
    assert s["output_throughput_tps"] == (3 + 3 + 3 + 1) / 2.0
    # TTFT over the 4 ok requests: 0.2, 0.5, 0.9, 1.5 s -> p50 = 0.7 s
    assert s["ttft_ms"]["p50"] == pytest.approx(700.0)
    # pooled gaps: 0.05 x 4, 0.3 x 2 -> mean 0.1333 s
    assert s["tbt_ms"]["mean"] == pytest.approx(400 / 3)
    # e2e: 0.6, 1.6, 0.8, 0.9 s; mean in flight = 3.9 s busy / 2 s
    assert s["mean_in_flight"] == pytest.approx(1.95)


def test_slo_must_be_positive():
    with pytest.raises(ValueError, match="> 0 ms"):
        SLO(ttft_ms=0)
