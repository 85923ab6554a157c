"""SLO admission and the 429 it raises, from hand-built predictions; the Placer's bookkeeping."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.placement.admission import Admission
from router.errors import ErrorKind, RouterError
from router.metrics import RouterMetrics
from router.placement.prediction import SLO, Placement, Prediction
from router.placement.placer import Placer
from router.placement.state import PlacementBook
from tests.unit.router.placement.factories import booked_policy, policy, worker

DECODE = worker("d1", "decode")


def placement(ttft_s: float, queue_s: float, fits: bool = True) -> Placement:
    return Placement(DECODE, None, "predicted_latency", Prediction(ttft_s, queue_s, 0.0, 0.01, fits, 0))


def test_refused_only_when_the_slo_is_missed_and_the_queue_is_past_the_bound() -> None:
    admission = Admission(SLO(ttft_s=1.0), max_queue_s=0.5)
    admission.check(placement(ttft_s=0.9, queue_s=0.8), "r")  # meets the SLO
    admission.check(placement(ttft_s=3.0, queue_s=0.4), "r")  # a long prompt on a short queue
    with pytest.raises(RouterError) as info:
        admission.check(placement(ttft_s=3.0, queue_s=2.2), "r1")
    err = info.value
    assert (err.kind, err.http_status, err.grpc_code) == (
        ErrorKind.SLO_UNATTAINABLE, 429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert err.message == ("request r1 refused: predicted TTFT 3.000 s > SLO 1 s; the queue ahead takes 2.200 s "
                           "(bound 0.5 s)")
    assert (err.retry_after_s, err.retry_after) == (2.2, "3")  # whole seconds, rounded up
    assert err.http_headers() == {"Retry-After": "3"}
    assert err.grpc_trailing_metadata() == (("retry-after", "3"),)
    assert err.to_openai()["error"]["code"] == "slo_unattainable"


def test_a_decode_worker_that_cannot_fit_it_counts_as_a_miss() -> None:
    admission = Admission(SLO(tbt_s=0.05), max_queue_s=0.0)
    with pytest.raises(RouterError, match="decode worker d1 cannot take it") as info:
        admission.check(placement(ttft_s=0.1, queue_s=0.2, fits=False), "r")
    assert info.value.retry_after == "1"  # at least 1 s


def test_no_slo_or_no_prediction_admits_everything() -> None:
    Admission(SLO(), max_queue_s=0.0).check(placement(ttft_s=99.0, queue_s=99.0, fits=False), "r")
    no_prediction = Placement(DECODE, None, "least_loaded", None)
    Admission(SLO(ttft_s=0.1), max_queue_s=0.0).check(no_prediction, "r")


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="max_queue_s must be >= 0, got -1"):
        Admission(max_queue_s=-1)
    with pytest.raises(ValueError, match="SLOs must be >= 0 s, got ttft_s=-0.5"):
        SLO(ttft_s=-0.5)
    assert RouterError("x", ErrorKind.UNAVAILABLE).http_headers() == {}


class FakePoolIndex:
    """The pool holds the first ``num_blocks`` blocks of every prompt."""

    def __init__(self, num_blocks: int):
        self.num_blocks, self.calls = num_blocks, []

    async def num_cached_blocks(self, fingerprint: str, hashes) -> int:
        self.calls.append((fingerprint, len(hashes)))
        return min(self.num_blocks, len(hashes))


def test_placer_tracks_pending_tokens_until_the_first_token_and_refuses_a_burst() -> None:
    metrics = RouterMetrics()
    book, pl = booked_policy("predicted_latency", disaggregation="always", slo=SLO(ttft_s=0.2))
    pool = FakePoolIndex(num_blocks=2)
    placer = Placer(book, pl, Admission(SLO(ttft_s=0.2), max_queue_s=0.3), metrics, pool)
    prefills, decodes = [worker("p1")], [worker("d1", "decode")]

    async def burst() -> list:
        results = []
        for i in range(4):
            try:
                results.append(await placer.place(f"r{i}", list(range(i * 1000, i * 1000 + 200)), 8, prefills, decodes))
            except RouterError as err:
                results.append(err)
        return results

    results = asyncio.run(burst())
    assert pool.calls == [("fp-test", 12)] * 4  # 200 tokens = 12 full blocks of 16, one HMGET each
    # Each admitted prompt queues 200 - 32 pool-cached = 168 tokens (~0.18 s) at p1: the third
    # sees 0.36 s queued (> 0.3 s bound) and a TTFT over the SLO, and so does the fourth.
    assert [type(r).__name__ for r in results] == ["Placement", "Placement", "RouterError", "RouterError"]
    assert pl.view.pending_tokens("127.0.0.1:9001") == 2 * 168
    placer.first_token(results[0], ttft_s=0.19)
    placer.finished(results[0])
    placer.finished(results[1])  # ended without a first token (an error): forgotten too
    assert pl.view.pending_tokens("127.0.0.1:9001") == 0
    assert metrics.placements.labels(policy="predicted_latency", mode="disaggregated")._value.get() == 2
    assert metrics.ttft_prediction_ratio.labels(mode="disaggregated")._sum.get() == pytest.approx(
        0.19 / results[0].prediction.ttft_s)


def test_placer_is_the_one_no_worker_check_and_owns_in_flight() -> None:
    book, ll = booked_policy("least_loaded")
    placer = Placer(book, ll)
    with pytest.raises(RouterError, match="no healthy decode worker is registered") as info:
        asyncio.run(placer.place("r1", [1, 2, 3], 4, [worker("p1")], []))
    assert info.value.kind is ErrorKind.NO_WORKER
    assert (info.value.http_status, info.value.http_headers()) == (503, {"Retry-After": "5"})
    assert info.value.grpc_trailing_metadata() == (("retry-after", "5"),)
    with pytest.raises(RouterError, match="no healthy prefill worker is registered"):
        placer.choose("prefill", [], "r1", [1, 2, 3])
    busy, idle = worker("d1", "decode"), worker("d2", "decode")
    with placer.attempt(busy.address):
        assert ll.view.in_flight(busy.address) == 1
        assert placer.choose("decode", [busy, idle], "r1", [1, 2, 3]).worker_id == "d2"
    assert ll.view.in_flight(busy.address) == 0
    with pytest.raises(ValueError, match="reads another PlacementBook"):
        Placer(PlacementBook(), ll)
