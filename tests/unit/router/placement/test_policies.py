"""Each routing policy driven from hand-built worker states (no model, no network)."""

from __future__ import annotations

import time

import pytest

from core.registry import WorkerInfo
from router.config import ROUTING_POLICIES
from router.placement.prediction import COLOCATED, DISAGGREGATED, SLO
from router.placement.state import PlacementBook
from router.placement.policies import POLICIES, LeastLoadedPolicy, make_policy
from tests.unit.router.placement.factories import COST, booked_policy, policy, request, worker

REQUEST = request()


def test_every_configurable_policy_exists() -> None:
    assert sorted(POLICIES) == sorted(ROUTING_POLICIES)
    with pytest.raises(ValueError, match="unknown routing policy 'random'"):
        make_policy("random", PlacementBook().view)
    with pytest.raises(ValueError, match="disaggregation must be one of .* got 'sometimes'"):
        make_policy("least_loaded", PlacementBook().view, "sometimes")


# --- round robin -------------------------------------------------------------------------------


def test_round_robin_takes_turns_per_role_whatever_the_load() -> None:
    rr = policy("round_robin")
    prefills = [worker("p2", waiting_tokens=5000), worker("p1")]
    decodes = [worker("d1", "decode"), worker("d2", "decode", running=40)]
    placed = [rr.place(prefills, decodes, REQUEST) for _ in range(4)]
    assert [(p.prefill.worker_id, p.decode.worker_id) for p in placed] == [
        ("p1", "d1"), ("p2", "d2"), ("p1", "d1"), ("p2", "d2")]
    assert {p.mode for p in placed} == {DISAGGREGATED}


# --- least loaded ------------------------------------------------------------------------------


def test_least_loaded_fewest_running_plus_waiting() -> None:
    ll = policy("least_loaded")
    workers = [worker("w1", running=3), worker("w2", running=1, waiting=1), worker("w3", waiting=4)]
    assert ll.choose(workers, REQUEST).worker_id == "w2"


def test_least_loaded_counts_own_in_flight_when_the_heartbeat_lags() -> None:
    book = PlacementBook()
    ll = LeastLoadedPolicy(book.view)
    w1, w2 = worker("w1", running=1), worker("w2", running=2)
    with book.track(w1.address), book.track(w1.address), book.track(w1.address):
        assert ll.load(w1) == 3  # the heartbeat says 1: it has not seen our three yet
        assert ll.choose([w1, w2], REQUEST).worker_id == "w2"
    assert book.view.in_flight(w1.address) == 0
    assert ll.choose([w1, w2], REQUEST).worker_id == "w1"


def test_least_loaded_ties_go_to_free_blocks_then_worker_id() -> None:
    ll = policy("least_loaded")
    assert ll.choose([worker("w1", free_blocks=10), worker("w2", free_blocks=50)], REQUEST).worker_id == "w2"
    assert ll.choose([worker("w2"), worker("w1")], REQUEST).worker_id == "w1"
    bare = WorkerInfo("w9", "prefill", "127.0.0.1:1")  # no load fields at all: counts as idle
    assert ll.choose([worker("w1", running=1), bare], REQUEST) is bare


def test_the_view_has_readers_only() -> None:
    book, ll = booked_policy("least_loaded")
    assert not hasattr(ll.view, "track") and not hasattr(ll.view, "add_pending")
    with pytest.raises(AttributeError):
        ll.view.extra = 1  # __slots__: nothing can be hung on it either
    book.add_pending("k", "127.0.0.1:9001", 7)
    assert ll.view.pending_tokens("127.0.0.1:9001") == 7  # a live view, not a copy


# --- cache aware -------------------------------------------------------------------------------


def test_cache_aware_follows_the_longest_prefix_sent_then_load() -> None:
    book, ca = booked_policy("cache_aware")
    d1, d2 = worker("d1", "decode"), worker("d2", "decode", running=5)
    hot = request(64)
    book.record_sent(d2.address, hot.block_hashes[:3])
    book.record_sent(d1.address, hot.block_hashes[:1])
    assert ca.choose([d1, d2], hot).worker_id == "d2"  # 3 blocks beat 1, whatever the load
    assert ca.choose([d1, d2], request(64, first=7)).worker_id == "d1"  # nothing cached: least loaded


# --- predicted latency -------------------------------------------------------------------------


def test_predicted_ttft_is_queue_plus_pool_load_plus_uncached_prefill() -> None:
    pl = policy("predicted_latency", disaggregation="always")
    p1 = worker("p1", waiting_tokens=1000)
    placement = pl.place([p1], [worker("d1", "decode")], request(100, pool_cached=32))
    prediction = placement.prediction
    # queue: 1000 tokens in ceil(1000 / 512) = 2 steps: 2 x (10 + 0.5) ms + 1000 x 1 ms
    assert prediction.queue_s == pytest.approx(1.021)
    # 32 tokens from the pool at 1 GB/s x 1000 B + one 68-token step: 10 + 68 + 0.5 ms
    assert prediction.ttft_s == pytest.approx(1.021 + 32e-6 + 0.0785)
    assert prediction.num_cached_tokens == 32
    assert prediction.handoff_s == pytest.approx(100e-6)  # the decode worker loads all 100 tokens
    assert prediction.tbt_s == pytest.approx(COST.decode_step_s(1, 100))


def test_predicted_latency_prefers_the_shorter_queue_not_the_fewer_requests() -> None:
    pl, ll = policy("predicted_latency", disaggregation="always"), policy("least_loaded")
    prefills = [worker("p1", waiting=1, waiting_tokens=3000), worker("p2", waiting=3, waiting_tokens=300)]
    decodes = [worker("d1", "decode")]
    assert ll.place(prefills, decodes, REQUEST).prefill.worker_id == "p1"
    assert pl.place(prefills, decodes, REQUEST).prefill.worker_id == "p2"


def test_predicted_latency_ties_are_broken_by_load_so_a_hot_prefix_spreads() -> None:
    book, pl = booked_policy("predicted_latency", disaggregation="always")
    prefills, decodes = [worker("p1"), worker("p2")], [worker("d1", "decode")]
    hot = request(256, pool_cached=240)  # both workers read the same pool: equal predictions
    with book.track(prefills[0].address):
        assert pl.place(prefills, decodes, hot).prefill.worker_id == "p2"
    assert pl.place(prefills, decodes, hot).prefill.worker_id == "p1"


def test_pending_prefills_make_a_burst_alternate() -> None:
    book, pl = booked_policy("predicted_latency", disaggregation="always")
    prefills, decodes = [worker("p1"), worker("p2")], [worker("d1", "decode")]
    chosen = []
    for i in range(4):
        placement = pl.place(prefills, decodes, request(600, request_id=f"r{i}"))
        book.add_pending(placement, placement.prefill.address, 600)  # what the Placer does
        chosen.append(placement.prefill.worker_id)
    assert chosen == ["p1", "p2", "p1", "p2"]


def test_a_heartbeat_taken_before_the_routers_work_ended_does_not_count_it() -> None:
    # p1's heartbeat still shows the 3000 prompt tokens this router placed there and then saw
    # prefilled (first token): p1 is idle. Counting them sent the next request to p2 (lacking
    # the prompt's prefix) for up to a heartbeat.
    book, pl = booked_policy("predicted_latency", disaggregation="always")
    p1, p2 = worker("p1", waiting=1, waiting_tokens=3000), worker("p2", waiting=1, waiting_tokens=300)
    decodes = [worker("d1", "decode")]
    p1.heartbeat_time_s = p2.heartbeat_time_s = time.time() - 0.5
    assert pl.place([p1, p2], decodes, REQUEST).prefill.worker_id == "p2"
    book.add_pending("earlier", p1.address, 3000)
    book.remove_pending("earlier")  # its first token: prefilled after p1's heartbeat
    assert pl.place([p1, p2], decodes, REQUEST).prefill.worker_id == "p1"
    p1.heartbeat_time_s = time.time() + 0.5  # a heartbeat after the end counts what it shows
    assert pl.place([p1, p2], decodes, REQUEST).prefill.worker_id == "p2"


def test_requests_that_ended_after_the_heartbeat_leave_the_decode_workers_count() -> None:
    book, ll = booked_policy("least_loaded")
    d1, d2 = worker("d1", "decode", running=1), worker("d2", "decode")
    d1.heartbeat_time_s = d2.heartbeat_time_s = time.time() - 0.5
    assert ll.choose([d1, d2], REQUEST).worker_id == "d2"
    with book.track(d1.address):  # a Decode stream of this router, ended since
        pass
    assert ll.choose([d1, d2], REQUEST).worker_id == "d1"  # 0 each: ties go to the worker id
    d1.heartbeat_time_s = 0.0  # a heartbeat of unknown time: taken as it is
    assert ll.choose([d1, d2], REQUEST).worker_id == "d2"


def test_decode_worker_over_the_tbt_slo_or_out_of_blocks_is_avoided() -> None:
    pl = policy("predicted_latency", disaggregation="always", slo=SLO(tbt_s=0.030))
    prefills = [worker("p1")]
    busy = worker("d1", "decode", running=20, kv_tokens=20_000)  # 10 + 21 + 10.5 ms + attention 0 > 30 ms
    full = worker("d2", "decode", free_blocks=3)  # 100 + 16 tokens need 8 blocks
    ok = worker("d3", "decode", running=10, kv_tokens=5000)
    placement = pl.place(prefills, [busy, full, ok], REQUEST)
    assert placement.decode.worker_id == "d3" and placement.prediction.fits
    only_bad = pl.place(prefills, [busy, full], REQUEST)  # nothing fits: still placed, flagged
    assert not only_bad.prediction.fits


def test_conditional_disaggregation_colocates_a_mostly_cached_prompt() -> None:
    book, pl = booked_policy("predicted_latency")
    prefills, decode = [worker("p1")], worker("d1", "decode", running=8, kv_tokens=4000)
    long_new = request(1000)
    # Same speed both sides, but colocated chunks share their steps with 8 running decodes.
    assert pl.place(prefills, [decode], long_new).mode == DISAGGREGATED
    cached = request(1000, first=5000)
    book.record_sent(decode.address, cached.block_hashes)  # the decode worker has it all
    placement = pl.place(prefills, [decode], cached)
    assert (placement.mode, placement.prediction.num_cached_tokens) == (COLOCATED, 992)  # 62 full blocks
    assert pl.place([], [decode], long_new).mode == COLOCATED  # no prefill worker at all


def test_a_long_prompt_is_not_colocated_beside_running_decodes() -> None:
    prefills = [worker("p1", waiting_tokens=2000)]  # a 2 s queue at the prefill worker
    prompt = request(1500)
    idle = worker("d1", "decode")
    assert policy("predicted_latency").place(prefills, [idle], prompt).mode == COLOCATED  # nobody to stall
    busy = worker("d1", "decode", running=8, kv_tokens=4000)
    # A 512-token chunk (0.52 s) would stall 8 decodes for > 2 of their 22 ms steps: not colocated,
    # with or without a TBT SLO.
    assert policy("predicted_latency").place(prefills, [busy], prompt).mode == DISAGGREGATED
    assert policy("predicted_latency", slo=SLO(tbt_s=0.1)).place(prefills, [busy], prompt).mode == DISAGGREGATED
    short = request(16)  # one 16-token chunk: 26.5 ms + the batch's 12 ms share, under 2 x 22 ms
    assert policy("predicted_latency").place(prefills, [busy], short).mode == COLOCATED
    # 40 tokens: 50.5 + 12 ms, over 2 x 22 ms.
    assert policy("predicted_latency").place(prefills, [busy], request(40)).mode == DISAGGREGATED


def test_prompts_queued_at_the_decode_worker_share_the_mixed_step() -> None:
    """The engine fills one mixed step with every queued prompt's chunk: a short prompt that
    would fit alone stalls the running decodes for the whole queue behind it (its heartbeat's
    waiting tokens, or this router's pending placements there)."""
    prefills = [worker("p1", waiting_tokens=2000)]
    short = request(16)
    queued = worker("d1", "decode", running=8, kv_tokens=4000, waiting_tokens=100)
    # 116 tokens in the step: 10.5 + 116 + 12 ms, over 2 x 22 ms.
    assert policy("predicted_latency").place(prefills, [queued], short).mode == DISAGGREGATED
    book, pl = booked_policy("predicted_latency")
    busy = worker("d1", "decode", running=8, kv_tokens=4000)
    assert pl.place(prefills, [busy], short).mode == COLOCATED
    book.add_pending("earlier", busy.address, 100)  # a colocated placement not yet prefilled
    placement = pl.place(prefills, [busy], short)
    assert placement.mode == DISAGGREGATED


def test_an_idle_cluster_disaggregates_a_fresh_prompt() -> None:
    # Colocated would only save the decode worker's KV load (0.1 ms): a tie, and ties go to the
    # disaggregated path, which also stores the prompt's blocks in the pool for later requests.
    placement = policy("predicted_latency").place([worker("p1")], [worker("d1", "decode")], request(100))
    assert placement.mode == DISAGGREGATED


@pytest.mark.parametrize(("mode", "expected"), [("always", DISAGGREGATED), ("never", COLOCATED)])
def test_disaggregation_setting_forces_the_mode(mode: str, expected: str) -> None:
    book, pl = booked_policy("predicted_latency", disaggregation=mode)
    decode = worker("d1", "decode")
    cached = request(200)
    book.record_sent(decode.address, cached.block_hashes)
    assert pl.place([worker("p1", waiting_tokens=5000)], [decode], cached).mode == expected


def test_without_a_fitted_cost_model_predicted_latency_is_least_loaded() -> None:
    pl = policy("predicted_latency")
    prefills = [worker("p1", cost=None, running=2), worker("p2", cost=None)]
    decodes = [worker("d1", "decode", cost=None, running=1), worker("d2", "decode", cost=None)]
    placement = pl.place(prefills, decodes, REQUEST)
    assert (placement.prefill.worker_id, placement.decode.worker_id, placement.prediction) == ("p2", "d2", None)


def test_predicted_latency_choose_for_a_retry() -> None:
    pl = policy("predicted_latency")
    assert pl.choose([worker("p1", waiting_tokens=900), worker("p2", waiting_tokens=100)], REQUEST).worker_id == "p2"
    busy, idle = worker("d1", "decode", running=30, kv_tokens=9000), worker("d2", "decode", running=2)
    assert pl.choose([busy, idle], REQUEST).worker_id == "d2"
