"""A prefill-worker shortage is a counted, visible fall-back to colocated, never a silent one."""

from __future__ import annotations

import pytest

from router.placement.fallback import ColocatedFallbacks
from router.metrics import RouterMetrics
from tests.unit.router.test_failover import counter, make_generation, run


async def test_a_failed_prefill_with_no_prefill_worker_left_is_counted(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer, num_prefill=1)
    clients.failing_prefills.add("prefill:0")
    tokens, _ = await run(generation)
    assert tokens == clients.answer
    assert counter(generation, "tandem:colocated_fallbacks_total", reason="prefill_failed") == 1
    assert generation.fallbacks.counts == {"prefill_failed": 1}
    assert generation.fallbacks.mode(0) == "colocated_fallback"


async def test_placing_without_the_prefill_workers_seen_before_is_counted(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer, num_prefill=1)
    await run(generation)  # disaggregated: the prefill worker is seen
    assert generation.fallbacks.counts == {} and generation.fallbacks.mode(1) == "disaggregated"
    view.mark_down("prefill:0", "test")
    tokens, _ = await run(generation)
    assert tokens == clients.answer and clients.decode_calls[-1][2] is False  # colocated
    assert counter(generation, "tandem:colocated_fallbacks_total", reason="no_prefill_worker") == 1


async def test_a_cluster_that_never_had_a_prefill_worker_is_just_colocated(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer, num_prefill=0)
    await run(generation)
    assert generation.fallbacks.counts == {} and generation.fallbacks.mode(0) == "colocated"
    assert counter(generation, "tandem:colocated_fallbacks_total", reason="no_prefill_worker") == 0


def test_unknown_reasons_are_refused():
    with pytest.raises(ValueError, match="reason must be one of"):
        ColocatedFallbacks(RouterMetrics()).count("bored")
