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
