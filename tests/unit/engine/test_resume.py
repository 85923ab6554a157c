"""A resumed request (one that arrives with output tokens already generated, as after a decode
worker failed): its outputs are computed like prompt chunks and count as outputs."""

from __future__ import annotations

from core.request import FinishReason
from engine.outputs import ExternalKV
from tests.factories import fake_runner_output, make_request, make_scheduler


def resumed(num_prompt_tokens: int, outputs: list[int], max_tokens: int, **params):
    request = make_request(num_prompt_tokens, max_tokens=max_tokens, **params)
    for token_id in outputs:
        assert request.append_output_token(token_id) is None
    return request


def test_outputs_are_recomputed_in_chunks_then_sampling_continues():
    s = make_scheduler(max_num_batched_tokens=8, block_size=4)
    r = resumed(10, [50, 51, 52, 53], max_tokens=6)
    s.add_request(r)
    steps = []
    while s.num_unfinished:
        out = s.schedule()
        steps.append([(x.num_new_tokens, x.samples) for x in out.scheduled])
        s.update_from_output(out, fake_runner_output(out, 100))
    # 14 tokens (10 prompt + 4 outputs) in chunks of 8 and 6, the second samples; then one decode.
    assert steps == [[(8, False)], [(6, True)], [(1, True)]]
    assert r.output_token_ids == [50, 51, 52, 53, 100, 100]  # max_tokens counts the resumed outputs
    assert r.finish_reason is FinishReason.LENGTH


def test_pool_kv_covers_the_prompt_blocks_and_the_rest_is_computed():
    s = make_scheduler(max_num_batched_tokens=32, block_size=4)
    r = resumed(8, [60, 61, 62], max_tokens=8)
    s.add_request(r, ExternalKV(8, [b"k0", b"k1"]))  # the prompt's two full blocks, from the pool
    out = s.schedule()
    assert [(x.num_new_tokens, x.samples) for x in out.scheduled] == [(3, True)]
    assert [len(load.payloads) for load in out.kv_loads] == [2]
    assert r.num_computed_tokens == 8


def test_min_tokens_counts_the_resumed_outputs():
    r = resumed(4, [70, 71], max_tokens=8, min_tokens=3)
    assert r.append_output_token(2) is None  # EOS at output index 2 (< min_tokens) does not stop
    assert r.append_output_token(2) is FinishReason.STOP
