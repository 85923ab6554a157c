"""Placer: which worker's local prefix view a placed prompt joins, and when."""

from __future__ import annotations

import asyncio

from router.placement.placer import Placer
from router.placement.prediction import COLOCATED, DISAGGREGATED
from tests.unit.router.placement.factories import booked_policy, request, worker


def test_a_decode_worker_holds_the_prompt_only_once_its_decode_stream_opens() -> None:
    book, policy = booked_policy("predicted_latency")
    placer = Placer(book, policy)
    prefill, decode = worker("p1"), worker("d1", "decode", running=8, kv_tokens=4000)
    prompt = request(1000, first=5000).prompt_token_ids  # 62 full blocks
    first = asyncio.run(placer.place("r1", prompt, 1, [prefill], [decode]))
    assert first.mode == DISAGGREGATED and len(first.block_hashes) == 62
    assert (book.view.local_cached_blocks(prefill.address, first.block_hashes),
            book.view.local_cached_blocks(decode.address, first.block_hashes)) == (62, 0)
    # It ended at its first token (no Decode): the same prompt again is still not the decode worker's.
    assert asyncio.run(placer.place("r2", prompt, 1, [prefill], [decode])).mode == DISAGGREGATED
    placer.decoding(decode.address, first)  # a Decode stream opened: the manifest is loaded there
    assert book.view.local_cached_blocks(decode.address, first.block_hashes) == 62
    third = asyncio.run(placer.place("r3", prompt, 16, [prefill], [decode]))
    assert (third.mode, third.prediction.num_cached_tokens) == (COLOCATED, 992)


def test_colocated_placement_counts_the_prompt_on_the_decode_worker() -> None:
    book, policy = booked_policy("least_loaded")
    placer = Placer(book, policy)
    decode = worker("d1", "decode")
    placement = asyncio.run(placer.place("r1", request(40).prompt_token_ids, 1, [], [decode]))
    assert placement.mode == COLOCATED
    assert book.view.local_cached_blocks(decode.address, placement.block_hashes) == 2
    placer.decoding(decode.address, None)  # never placed: nothing to record


def test_a_burst_of_disaggregated_requests_spreads_over_the_decode_workers() -> None:
    """Their Decode streams open only after their prefills: until then each placed request counts
    at its decode worker, or every request of a burst sees the same idle workers."""
    book, policy = booked_policy("predicted_latency", disaggregation="always")
    placer = Placer(book, policy)
    prefills = [worker("p1"), worker("p2")]
    decodes = [worker("d1", "decode"), worker("d2", "decode")]
    placed = [asyncio.run(placer.place(f"r{i}", request(40, first=100 * i).prompt_token_ids, 8, prefills, decodes))
              for i in range(6)]
    assert {p.mode for p in placed} == {DISAGGREGATED}
    assert sorted(p.decode.worker_id for p in placed) == ["d1", "d1", "d1", "d2", "d2", "d2"]
    d1 = decodes[0].address
    assert (book.view.awaiting_decode(d1), policy.load(decodes[0])) == (3, 3)
    first_at_d1 = next(p for p in placed if p.decode.address == d1)
    with placer.attempt(d1):  # its Decode stream opens: counted in flight instead, once
        placer.decoding(d1, first_at_d1)
        assert (book.view.awaiting_decode(d1), book.view.in_flight(d1), policy.load(decodes[0])) == (2, 1, 3)
    for p in placed:
        placer.finished(p)
    assert [book.view.awaiting_decode(d.address) for d in decodes] == [0, 0]
    assert [policy.load(d) for d in decodes] == [0, 0]
