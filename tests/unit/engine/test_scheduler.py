"""Scheduler behaviour from plain ints: token budget, chunking, continuous batching (preemption:
test_preemption.py)."""

from __future__ import annotations

import pytest


from core.block_hash import hash_block_chain
from core.request import FinishReason, RequestStatus
from engine.kv_connector.blocks import ArenaBlock, LoadGuard
from engine.outputs import ExternalKV
from tests.factories import fake_runner_output, make_request, make_scheduler


def run_step(scheduler, token_id=100):
    out = scheduler.schedule()
    outputs = scheduler.update_from_output(out, fake_runner_output(out, token_id))
    for o in outputs:
        if o.finished:
            scheduler.free(o.request_id)
    return out, outputs


def test_prompt_is_chunked_under_token_budget():
    s = make_scheduler(max_num_batched_tokens=8)
    r = make_request(20, max_tokens=1)
    s.add_request(r)
    chunks = []
    while s.num_unfinished:
        out, _ = run_step(s)
        chunks.append([x.num_new_tokens for x in out.scheduled])
    assert chunks == [[8], [8], [4]]
    assert r.output_token_ids == [100] and r.finish_reason is FinishReason.LENGTH
    assert s.kv.num_used_blocks == 0


def test_decodes_go_first_and_waiting_prefill_takes_the_rest_of_the_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    a = make_request(4, max_tokens=5)
    s.add_request(a)
    run_step(s)  # a prefilled, 1 output token
    b = make_request(30, max_tokens=2)
    s.add_request(b)
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [(a.request_id, 1), (b.request_id, 9)]


def test_prompts_beside_running_decodes_take_at_most_max_mixed_prefill_tokens_per_step():
    """With running decodes a step computes at most max_mixed_prefill_tokens prompt tokens (two
    waiting prompts share them); a step without decodes keeps the whole budget, and a prompt
    whose KV came from the pool (one token left) is not held back."""
    s = make_scheduler(max_num_batched_tokens=32, max_mixed_prefill_tokens=6, enable_prefix_caching=False)
    first = make_request(20, max_tokens=1)
    s.add_request(first)
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [20]  # no decode running: the whole budget
    a = make_request(4, max_tokens=8)
    s.add_request(a)
    run_step(s)  # a prefilled (nothing decodes yet), 1 output token
    b, c = make_request(10, max_tokens=1), make_request(5, max_tokens=1)
    s.add_request(b)
    s.add_request(c)
    steps = []
    for _ in range(3):
        out, _ = run_step(s)
        steps.append([(x.request_id, x.num_new_tokens) for x in out.scheduled])
    assert steps == [[(a.request_id, 1), (b.request_id, 6)],
                     [(a.request_id, 1), (b.request_id, 4), (c.request_id, 2)],
                     [(a.request_id, 1), (c.request_id, 3)]]
    d = make_request(12, max_tokens=2)
    s.add_request(d, ExternalKV(11, []))  # 11 of 12 tokens from the pool
    e = make_request(9, max_tokens=1)
    s.add_request(e)
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [(a.request_id, 1), (d.request_id, 1),
                                                                          (e.request_id, 6)]
    while s.num_unfinished:
        run_step(s)
    assert s.kv.num_used_blocks == 0


def test_a_request_with_its_kv_from_the_pool_starts_behind_a_prompt_that_waits_for_prompt_tokens():
    """When a step's mixed prompt tokens are spent, the prompt next in line keeps its place and a
    request behind it whose KV came from the pool (nothing to compute) starts in this step."""
    s = make_scheduler(max_num_batched_tokens=32, max_mixed_prefill_tokens=4, enable_prefix_caching=False)
    a = make_request(4, max_tokens=8)
    s.add_request(a)
    run_step(s)  # a decodes from here on
    b, c = make_request(10, max_tokens=1), make_request(9, max_tokens=1)
    d = make_request(12, max_tokens=2)
    s.add_request(b)
    s.add_request(c)
    s.add_request(d, ExternalKV(11, []))  # 11 of 12 tokens from the pool
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [(a.request_id, 1), (b.request_id, 4),
                                                                          (d.request_id, 1)]
    assert [r.request_id for r in s.waiting] == [c.request_id]  # c still next, not behind a later arrival
    while s.num_unfinished:
        run_step(s)
    assert s.kv.num_used_blocks == 0


def test_a_waiting_request_whose_first_decode_is_this_step_caps_the_prompt_tokens_beside_it():
    """No request runs yet, but one waits with its prompt's KV loaded from the pool: it decodes in
    this step, so the prompts beside it take max_mixed_prefill_tokens, not the whole budget."""
    s = make_scheduler(max_num_batched_tokens=32, max_mixed_prefill_tokens=6, enable_prefix_caching=False)
    d = make_request(12, max_tokens=2)
    b = make_request(20, max_tokens=1)
    s.add_request(d, ExternalKV(11, []))
    s.add_request(b)
    out, _ = run_step(s)
    assert [(x.request_id, x.num_new_tokens) for x in out.scheduled] == [(d.request_id, 1), (b.request_id, 6)]
    partial = make_request(12, max_tokens=1)  # a pool hit short of the whole prompt: it prefills, not decodes
    s2 = make_scheduler(max_num_batched_tokens=32, max_mixed_prefill_tokens=6, enable_prefix_caching=False)
    s2.add_request(partial, ExternalKV(8, []))
    s2.add_request(make_request(20, max_tokens=1))
    out, _ = run_step(s2)
    assert [x.num_new_tokens for x in out.scheduled] == [4, 20]


def test_on_a_decode_worker_that_streams_join_every_step_keeps_to_the_cap():
    """decodes_may_join (a disaggregated decode worker): with nothing decoding yet, local prompts
    still take max_mixed_prefill_tokens per step, so a stream handed over meanwhile waits one short
    step for its first decode; without it the first step takes the whole budget."""
    for may_join, first_step in ((False, [20, 12]), (True, [6])):
        s = make_scheduler(max_num_batched_tokens=32, max_mixed_prefill_tokens=6, enable_prefix_caching=False)
        s.decodes_may_join = may_join
        s.add_request(make_request(20, max_tokens=1))
        s.add_request(make_request(12, max_tokens=1))
        out, _ = run_step(s)
        assert [x.num_new_tokens for x in out.scheduled] == first_step
        while s.num_unfinished:
            run_step(s)
        assert s.kv.num_used_blocks == 0


@pytest.mark.parametrize(("share", "tokens"), [(1.0, 12), (0.5, 6), (0.25, 3), (0.01, 1)])
def test_the_mixed_prompt_tokens_shrink_with_the_share_of_the_cores_the_step_runs_on(share, tokens):
    """A decode worker on its own cores only (core sharing) computes a prompt token 1 / share as
    slowly: the cap is scaled by the share (at least one token)."""
    s = make_scheduler(max_num_batched_tokens=64, max_mixed_prefill_tokens=12, enable_prefix_caching=False)
    a = make_request(4, max_tokens=8)
    s.add_request(a)
    run_step(s)
    s.mixed_prefill_share = share
    s.add_request(make_request(30, max_tokens=1))
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1, tokens]


def test_max_mixed_prefill_tokens_is_refused_below_zero():
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens must be >= 0 \\(0: the token budget\\), got -1"):
        make_scheduler(max_mixed_prefill_tokens=-1)


def test_requests_join_and_leave_every_step():
    s = make_scheduler()
    a, b = make_request(4, max_tokens=1), make_request(4, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    run_step(s)
    assert a.is_finished and not b.is_finished
    c = make_request(4, max_tokens=1)
    s.add_request(c)
    out, _ = run_step(s)
    assert {x.request_id for x in out.scheduled} == {b.request_id, c.request_id}


def test_blocks_are_allocated_on_demand_and_freed_at_finish():
    s = make_scheduler(block_size=4)
    r = make_request(4, max_tokens=3)
    s.add_request(r)
    run_step(s)
    assert s.kv.num_used_blocks == 1  # 4 prompt tokens, first output token has no KV yet
    run_step(s)
    assert s.kv.num_used_blocks == 2  # token 5's KV needs a second block
    run_step(s)
    assert r.is_finished and s.kv.num_used_blocks == 0


def test_external_kv_counts_as_computed_except_the_last_token():
    s = make_scheduler(block_size=4)
    r = make_request(8, max_tokens=2)
    s.add_request(r, ExternalKV(8, [b"x", b"y"]))
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1]
    assert out.kv_loads[0].block_ids == out.scheduled[0].block_ids[:2]
    assert r.num_cached_tokens == 7


def test_decode_request_with_pool_kv_computes_one_token():
    s = make_scheduler(block_size=4)
    r = make_request(6, max_tokens=3)
    r.append_output_token(50)  # first token came from the prefill worker
    s.add_request(r, ExternalKV(6, [b"a", b"b"]))
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1] and r.num_computed_tokens == 7
    assert r.output_token_ids == [50, 100]


def test_abort_frees_blocks_and_marks_request():
    s = make_scheduler()
    r = make_request(9, max_tokens=10)
    s.add_request(r)
    run_step(s)
    assert s.kv.num_used_blocks == 3
    assert s.abort(r.request_id) is r
    assert r.finish_reason is FinishReason.ABORT and r.status is RequestStatus.FINISHED
    assert s.kv.num_used_blocks == 0 and s.num_unfinished == 0
    assert s.abort(r.request_id) is None


def test_max_num_seqs_caps_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for _ in range(3):
        s.add_request(make_request(4, max_tokens=5))
    out, _ = run_step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_request_over_max_model_len_is_refused():
    s = make_scheduler(max_model_len=16)
    try:
        s.add_request(make_request(10, max_tokens=7))
    except ValueError as err:
        assert "exceeds max_model_len (16)" in str(err)
    else:
        raise AssertionError("expected ValueError")
    assert s.num_unfinished == 0


def test_eos_stops_unless_ignored():
    s = make_scheduler()
    a = make_request(4, max_tokens=5)
    b = make_request(4, max_tokens=2, ignore_eos=True)
    s.add_request(a)
    s.add_request(b)
    run_step(s, token_id=2)
    assert a.finish_reason is FinishReason.STOP and a.output_token_ids == [2]
    assert not b.is_finished


def test_prefix_cache_shares_full_blocks_and_copies_a_fully_cached_last_block():
    s = make_scheduler(block_size=4)
    a = make_request(8, max_tokens=1)
    s.add_request(a)
    run_step(s)
    pool = s.kv.block_pool
    assert pool.num_cached_blocks == 2 and s.kv.num_used_blocks == 0
    block0, block1 = (pool.lookup(h) for h in hash_block_chain(a.prompt_token_ids, 4))
    # Same 8-token prompt: both blocks hit; the last token is recomputed into a copy of block 1.
    b = make_request(8, max_tokens=3)
    s.add_request(b)
    out, _ = run_step(s)
    assert [x.num_new_tokens for x in out.scheduled] == [1] and b.num_cached_tokens == 7
    table = s.kv.get(b.request_id).block_ids
    assert table[0] == block0 and table[1] != block1 and out.block_copies == [(block1, table[1])]
    assert pool.ref_count(block0) == 1 and pool.ref_count(block1) == 0
    # A third request starting with the same 4 tokens shares block 0 while b runs.
    c = make_request(6, max_tokens=1)
    s.add_request(c)
    out, _ = run_step(s)
    c_blocks = next(x.block_ids for x in out.scheduled if x.request_id == c.request_id)
    assert c_blocks[0] == block0 and c.num_cached_tokens == 4
    assert [x.num_new_tokens for x in out.scheduled if x.request_id == c.request_id] == [2]
    while s.num_unfinished:
        run_step(s)
    assert s.kv.num_used_blocks == 0


def test_cached_blocks_are_evicted_least_recently_used_only_when_needed():
    s = make_scheduler(block_size=4, num_kv_blocks=4, max_model_len=16)
    first, second = make_request(4, max_tokens=1), make_request(5, max_tokens=1)
    second.prompt_token_ids[:] = [900 + i for i in range(5)]
    for r in (first, second):
        s.add_request(r)
        run_step(s)
    pool = s.kv.block_pool
    (first_hash,), (second_hash,) = (hash_block_chain(r.prompt_token_ids, 4) for r in (first, second))
    assert pool.num_cached_blocks == 2 and pool.num_free_blocks == 4 and pool.num_evictions == 0
    big = make_request(12, max_tokens=1)
    big.prompt_token_ids[:] = [500 + i for i in range(12)]
    s.add_request(big)
    run_step(s)  # needs 3 blocks: the 2 empty ones, then the least recently freed cached one
    assert pool.num_evictions == 1
    assert pool.lookup(first_hash) is None and pool.lookup(second_hash) is not None


def test_static_batching_admits_a_new_batch_only_when_the_last_one_finished():
    s = make_scheduler(scheduling_policy="static")
    short, long_ = make_request(4, max_tokens=1), make_request(4, max_tokens=4)
    s.add_request(short)
    s.add_request(long_)
    run_step(s)
    late = make_request(4, max_tokens=1)
    s.add_request(late)
    steps_before_late = 0
    while late.num_computed_tokens == 0:
        out, _ = run_step(s)
        steps_before_late += 1
    assert long_.is_finished and steps_before_late == 4  # 3 more decode steps, then the new batch


def run_decision(scheduler, num_steps, token_id=100):
    """One multi-step decision, as LLMEngine.step_stream drives it; returns tokens per pass."""
    out = scheduler.schedule()
    passes = []
    for i in range(num_steps):
        if i:
            out = scheduler.continue_decode(out)
            if out.is_empty:
                break
        outputs = scheduler.update_from_output(out, fake_runner_output(out, token_id))
        passes.append({o.request_id: o.new_token_ids for o in outputs})
        for o in outputs:
            if o.finished:
                scheduler.free(o.request_id)
    return passes


def test_multi_step_runs_n_passes_per_decision_and_stops_finished_requests_on_time():
    s = make_scheduler(block_size=4, num_scheduler_steps=4)
    short, long_ = make_request(4, max_tokens=3), make_request(4, max_tokens=9)
    s.add_request(short)
    s.add_request(long_)
    first = run_decision(s, 4)  # prefill pass, then 3 decode passes
    assert len(first) == 4
    assert [len(p) for p in first] == [2, 2, 2, 1]  # short finishes at its 3rd token
    assert short.output_token_ids == [100] * 3 and short.finish_reason is FinishReason.LENGTH
    second = run_decision(s, 4)
    assert [list(p) for p in second] == [[long_.request_id]] * 4
    assert long_.num_output_tokens == 8 and s.kv.get(long_.request_id).capacity_tokens >= long_.num_tokens
    run_decision(s, 4)
    assert long_.num_output_tokens == 9 and long_.is_finished and s.kv.num_used_blocks == 0


def prompt_logprobs_output(out, runner_out):
    """``runner_out`` with a fake prompt logprob per predicted position: logprob -position."""
    from engine.outputs import SampledToken

    for item in out.scheduled:
        if item.prompt_logprobs is not None:
            start = item.num_computed_tokens
            runner_out.prompt_logprobs[item.request_id] = [
                SampledToken(t, -float(start + k)) for k, t in enumerate(item.prompt_logprobs.target_token_ids)]
    return runner_out


def test_prompt_logprobs_cover_every_chunk_skip_the_prefix_cache_and_come_with_the_first_token():
    s = make_scheduler(max_num_batched_tokens=8)
    for round_ in range(2):  # round 1: the prompt's blocks are cached, computed all the same
        r = make_request(20, max_tokens=2, request_id=f"r{round_}", prompt_logprobs=1)
        s.add_request(r)
        targets, got = [], None
        while s.num_unfinished:
            out = s.schedule()
            targets += [x.prompt_logprobs.target_token_ids for x in out.scheduled if x.prompt_logprobs]
            for o in s.update_from_output(out, prompt_logprobs_output(out, fake_runner_output(out))):
                if o.prompt_logprobs is not None:
                    assert got is None
                    got = o.prompt_logprobs
                if o.finished:
                    s.free(o.request_id)
        prompt = r.prompt_token_ids
        assert targets == [prompt[1:9], prompt[9:17], prompt[17:20]]  # position p predicts token p + 1
        assert [(t.token_id, t.logprob) for t in got] == [(t, -float(p)) for p, t in enumerate(prompt[1:])]
        assert r.num_cached_tokens == 0
    assert s.prompt_logprobs == {}


def test_prompt_logprobs_of_a_recomputed_prompt_are_not_added_twice():
    s = make_scheduler(max_num_batched_tokens=8)
    r = make_request(12, max_tokens=2, prompt_logprobs=0)
    s.add_request(r)
    out = s.schedule()  # positions 0..7
    s.update_from_output(out, prompt_logprobs_output(out, fake_runner_output(out)))
    s._preempt(r, out)  # before its first token: recomputed from position 0
    outputs = []
    while not outputs:
        out = s.schedule()
        outputs = s.update_from_output(out, prompt_logprobs_output(out, fake_runner_output(out)))
    assert [t.token_id for t in outputs[0].prompt_logprobs] == r.prompt_token_ids[1:]
    assert [t.logprob for t in outputs[0].prompt_logprobs] == [-float(p) for p in range(11)]


def pool_views(n: int, released: list) -> list:
    """``n`` blocks as pool arena views under one guard, as one pool fetch gives them; the guard
    (which keeps the request's pool leases) appends to ``released`` when it is done."""
    guard = LoadGuard(lambda: released.append(True))
    return [ArenaBlock.wrap(memoryview(bytearray(16)), guard) for _ in range(n)]


def test_external_kv_the_prefix_cache_covers_lets_go_of_its_pool_views_at_admission():
    # A partial manifest (1 of 3 blocks) whose block this worker's prefix cache already holds:
    # nothing is copied, and the views must not keep the pool leases until they are garbage
    # (the Decode RPC holding them would keep them for the request's life).
    s = make_scheduler(block_size=4)
    first = make_request(8, max_tokens=1)
    s.add_request(first)
    run_step(s)
    released: list = []
    views = pool_views(1, released)
    second = make_request(8, max_tokens=2)
    s.add_request(second, ExternalKV(4, views))
    out, _ = run_step(s)
    assert out.kv_loads == [] and released == [True]
    assert views  # still referenced here: the release did not wait for the collection


def test_external_kv_copied_in_part_is_let_go_by_the_copy_not_at_admission():
    s = make_scheduler(block_size=4)
    released: list = []
    views = pool_views(2, released)
    s.add_request(make_request(8, max_tokens=2), ExternalKV(8, views))
    out, _ = run_step(s)
    assert [len(load.payloads) for load in out.kv_loads] == [2] and released == []


def test_abort_of_a_waiting_request_lets_go_of_its_external_kv():
    s = make_scheduler(block_size=4)
    released: list = []
    views = pool_views(2, released)
    r = make_request(8, max_tokens=2)
    s.add_request(r, ExternalKV(8, views))
    assert s.abort(r.request_id) is r and released == [True] and views
