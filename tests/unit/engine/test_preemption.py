"""Preemption from plain ints: the PreemptionPolicy's choices (victim, swap or recompute), and
the scheduler acting on them: a recomputed victim, and a swapped one whose KV the engine brings
back before ``schedule()`` (which itself never touches the swap space)."""

from __future__ import annotations

import pytest

from core.request import FinishReason
from engine.kv_connector.swap import HostSwapSpace
from engine.outputs import ExternalKV
from engine.preemption import PreemptionMode, PreemptionPolicy
from engine.scheduler import Scheduler
from tests.factories import fake_runner_output, make_request, make_scheduler
from tests.unit.engine.test_scheduler import run_step


def test_policy_picks_the_youngest_running_request():
    running = [make_request(4, request_id="old"), make_request(4, request_id="mid"), make_request(4, request_id="new")]
    assert PreemptionPolicy("swap").victim(running).request_id == "new"
    assert PreemptionPolicy("recompute").victim(running[:2]).request_id == "mid"


def test_policy_swaps_only_a_request_with_computed_kv_and_only_in_swap_mode():
    r = make_request(8)
    swap, recompute = PreemptionPolicy("swap"), PreemptionPolicy("recompute")
    assert swap.mode_for(r) is PreemptionMode.RECOMPUTE  # nothing computed: nothing to save
    r.num_computed_tokens = 5
    assert swap.mode_for(r) is PreemptionMode.SWAP
    assert recompute.mode_for(r) is PreemptionMode.RECOMPUTE
    with pytest.raises(ValueError):
        PreemptionPolicy("drop")


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_newest_request_is_preempted_and_recomputed_when_blocks_run_out(caching):
    s = make_scheduler(block_size=4, num_kv_blocks=4, max_model_len=16, enable_prefix_caching=caching)
    old, new = make_request(7, max_tokens=8), make_request(7, max_tokens=8)
    s.add_request(old)
    s.add_request(new)
    run_step(s)  # each holds 2 blocks
    preempted = []
    while not old.is_finished:
        out, _ = run_step(s)
        preempted += out.preempted_request_ids
    # Without a prefix cache the victim waits for its whole prompt to fit again; with one, it
    # comes back on its cached blocks as soon as one is free, and may be preempted again.
    assert set(preempted) == {new.request_id}
    assert s.num_preemptions == len(preempted) and (caching or len(preempted) == 1)
    while s.num_unfinished:
        run_step(s)
    assert new.output_token_ids == [100] * 8 and new.finish_reason is FinishReason.LENGTH
    assert s.kv.num_used_blocks == 0



def swap_scheduler() -> Scheduler:
    # No prefix cache: it would find the victim's freed blocks and need no swap-in at all.
    config = make_scheduler(block_size=4, num_kv_blocks=4, max_model_len=16, enable_prefix_caching=False).config
    return Scheduler(config, PreemptionPolicy("swap"))


def preempt_newest(s: Scheduler, swap: HostSwapSpace):
    """Runs steps until ``s`` preempts; packs the victim's KV into ``swap`` as the engine does."""
    while True:
        out = s.schedule()
        swaps = list(out.swap_outs)
        for item in swaps:
            assert swap.put(item.request_id, ExternalKV(item.num_tokens, [b"k0", b"k1"]))
        out.swap_outs.clear()
        s.update_from_output(out, fake_runner_output(out))
        if swaps:
            return swaps


def one_swapped_victim():
    """Two 7-token requests on a swap scheduler, one step, then the newest preempted into a host
    swap space. Returns (scheduler, swap space, old request, new request, the victim's swap-out)."""
    swap = HostSwapSpace(capacity_bytes=1 << 20)
    s = swap_scheduler()
    old, new = make_request(7, max_tokens=8), make_request(7, max_tokens=8)
    s.add_request(old)
    s.add_request(new)
    run_step(s)
    (item,) = preempt_newest(s, swap)
    return s, swap, old, new, item


def test_swapped_victim_is_admitted_only_once_its_kv_is_back():
    s, swap, old, new, item = one_swapped_victim()
    # 7 prompt tokens + its first output token had their KV computed: 2 blocks of 4
    assert (item.request_id, item.num_tokens, len(item.block_ids)) == (new.request_id, 8, 2)
    assert s.swapped == {new.request_id}
    while s.kv.num_used_blocks > 2:  # blocks free up as old decodes... but the victim's KV is not back
        run_step(s)
    while not old.is_finished:
        out, _ = run_step(s)
        assert new.request_id not in {x.request_id for x in out.scheduled}
    assert new.num_computed_tokens == 0 and s.swap_in_candidates() == [new.request_id]
    s.resume_swapped(new.request_id, swap.take(new.request_id))  # what the engine does before schedule()
    out, _ = run_step(s)
    item = next(x for x in out.scheduled if x.request_id == new.request_id)
    assert item.num_new_tokens == 1 and out.kv_loads[0].payloads == [b"k0", b"k1"]
    assert swap.used_bytes == 0 and s.swapped == set()
    while s.num_unfinished:
        run_step(s)
    assert new.output_token_ids == [100] * 8 and s.kv.num_used_blocks == 0


def test_lost_swap_is_recomputed():
    s, swap, old, new, _ = one_swapped_victim()
    swap.discard(new.request_id)
    while not old.is_finished:
        run_step(s)
    s.resume_swapped(new.request_id, swap.take(new.request_id))  # None: gone
    out, _ = run_step(s)
    item = next(x for x in out.scheduled if x.request_id == new.request_id)
    # Recomputed from scratch: 7 prompt tokens + the 2 output tokens it had when preempted.
    assert item.num_computed_tokens == 0 and item.num_new_tokens == 9 and out.kv_loads == []
    while s.num_unfinished:
        run_step(s)
    assert new.output_token_ids == [100] * 8 and new.finish_reason is FinishReason.LENGTH
    assert s.kv.num_used_blocks == 0
