"""ModelRunner's step inputs from plain ints: a hand-built SchedulerOutput (no Request), no model.

One mixed step, block size 4::

    seq  request                       computes positions   blocks   samples
    0    "a" decode (5 prompt + 1 out)  5                    [7, 2]   yes
    1    "b" chunk after 4 cached       4 5 6 7              [3, 5]   no (10-token prompt)
    2    "c" uncached 3-token prompt    0 1 2                [6]      yes
"""

from __future__ import annotations

import torch

from core.sampling_params import SamplingParams
from engine.model_runner import ModelRunner
from engine.outputs import PLACEHOLDER_TOKEN_ID, SamplingInput, ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 4


def runner() -> ModelRunner:
    kv_cache = torch.zeros(1, 2, 8, BLOCK_SIZE, 1, 2)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
    return ModelRunner(model=None, kv_cache=kv_cache, backend=None, sampler=None)


PARAMS = SamplingParams(temperature=0, max_tokens=8)
PENALISED = SamplingParams(temperature=0, max_tokens=8, presence_penalty=0.5)


def sampling(request_id: str, prompt: list[int], outputs: list[int], params=PARAMS) -> SamplingInput:
    return SamplingInput(request_id, params, len(outputs), frozenset({2}), prompt, outputs)


def mixed_step(last_token_of_a: int = 15) -> SchedulerOutput:
    a_prompt, c_prompt = [10, 11, 12, 13, 14], [40, 41, 42]
    return SchedulerOutput([
        ScheduledRequest("a", [last_token_of_a], 5, [7, 2], sampling("a", a_prompt, [last_token_of_a], PENALISED)),
        ScheduledRequest("b", [24, 25, 26, 27], 4, [3, 5]),  # 10-token prompt, 4 cached: no sample
        ScheduledRequest("c", c_prompt, 0, [6], sampling("c", c_prompt, [])),
    ])


def test_prepare_inputs_of_a_mixed_step():
    input_ids, positions, meta, logits_indices = runner()._prepare_inputs(mixed_step())
    assert input_ids == [15, 24, 25, 26, 27, 40, 41, 42]
    assert positions.tolist() == [5, 4, 5, 6, 7, 0, 1, 2]
    # slot = block_table[pos // 4] * 4 + pos % 4: a's pos 5 in block 2; b's 4..7 in block 5; c's in block 6.
    assert meta.slot_mapping.tolist() == [9, 20, 21, 22, 23, 24, 25, 26]
    assert meta.query_start_loc.tolist() == [0, 1, 5, 8]
    assert meta.seq_lens.tolist() == [6, 8, 3]
    assert meta.block_tables.tolist() == [[7, 2], [3, 5], [6, 0]]  # padded with block 0
    assert (meta.max_query_len, meta.max_seq_len, meta.num_seqs) == (4, 8, 3)
    assert logits_indices.tolist() == [0, 7]  # the last token of a and of c; b does not sample
    for tensor in (positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                   logits_indices):
        assert tensor.dtype == torch.int64


def test_prepare_inputs_of_one_decode():
    # 8 prompt tokens: exactly 2 blocks, the first output in a 3rd
    out = SchedulerOutput([ScheduledRequest("d", [200], 8, [4, 1, 3], sampling("d", list(range(100, 108)), [200]))])
    input_ids, positions, meta, logits_indices = runner()._prepare_inputs(out)
    assert (input_ids, positions.tolist(), meta.slot_mapping.tolist()) == ([200], [8], [12])
    assert meta.seq_lens.tolist() == [9] and meta.block_tables.tolist() == [[4, 1, 3]]
    assert logits_indices.tolist() == [0] and meta.max_query_len == 1


def test_prepare_lists_placeholders_and_patches_them_with_the_sampled_token():
    """A decode whose last token is still being sampled by the running step (overlap)."""
    out = mixed_step(last_token_of_a=PLACEHOLDER_TOKEN_ID)
    step = runner().prepare(out)
    assert step.placeholders == [(0, "a")]
    assert [r.request_id for r in step.sampling] == ["a", "c"]
    # 8 tokens, 3 sequences; attention pairs: a 1 query over 6, b 4 over 5..8, c 3 over 1..3.
    assert step.features == (8, 3, (6 + (5 + 6 + 7 + 8) + (1 + 2 + 3)) / 1000)
    step.patch({"a": 99})
    assert step.input_ids[0] == 99 and step.placeholders == []
    assert step.sampling[0].output_token_ids == [99]  # the penalty history too
