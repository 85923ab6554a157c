"""A prefill-worker shortage is a counted, visible fall-back to colocated, never a silent one."""

from __future__ import annotations

import grpc
import pytest

from core.failure_metadata import KV_SAVE_FAILURE_KEY
from router.placement.fallback import ColocatedFallbacks
from router.errors import KVSaveFailedError, WorkerFailedError
from router.workers.clients import _router_error
from router.metrics import RouterMetrics
from tests.unit.router.test_generation import counter, make_generation, run


async def test_a_failed_prefill_with_no_prefill_worker_left_is_counted(tokenizer):
    generation, clients, _, _ = await make_generation(tokenizer, num_prefill=1)
    clients.failing_prefills.add("prefill:0")
    tokens, _ = await run(generation)
    assert tokens == clients.answer
    assert counter(generation, "tandem:colocated_fallbacks_total", reason="prefill_failed") == 1
    assert generation.fallbacks.counts == {"prefill_failed": 1}
    assert generation.fallbacks.mode(0) == "colocated_fallback"


async def test_a_prefill_whose_pool_write_failed_prefills_on_the_decode_worker_marking_nobody_down(tokenizer):
    generation, clients, view, _ = await make_generation(tokenizer)

    async def pool_broke(address, request_id, request, timeout_s):
        clients.prefill_calls.append((address, request_id))
        raise KVSaveFailedError("prefill worker could not write the KV cache to the pool: x", address)

    clients.prefill = pool_broke
    tokens, _ = await run(generation)
    assert tokens == clients.answer
    assert len(clients.prefill_calls) == 1  # not retried on the other prefill worker
    assert clients.decode_calls[0][2:] == (False, ())  # colocated: the decode worker prefills
    assert [w.address for w in view.workers("prefill")] == ["prefill:0", "prefill:1"]
    assert counter(generation, "tandem:colocated_fallbacks_total", reason="pool_write_failed") == 1
    assert counter(generation, "tandem:worker_failures_total", role="prefill") == 0


def test_a_pool_write_failure_in_trailing_metadata_is_not_a_worker_failure():
    trailing = grpc.aio.Metadata((KV_SAVE_FAILURE_KEY, "pool_write_failed"))
    err = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), trailing,
                               details="KV pool write failed: connection refused")
    error = _router_error("prefill", "prefill:0", err, 5.0)
    assert isinstance(error, KVSaveFailedError) and not isinstance(error, WorkerFailedError)
    assert (error.address, error.message) == (
        "prefill:0", "prefill worker could not write the KV cache to the pool: KV pool write failed: connection refused")


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
