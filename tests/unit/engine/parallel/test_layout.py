"""ShardLayout from plain ints: which heads, columns and rows each rank owns."""

from __future__ import annotations

import pytest

from engine.parallel.layout import ShardLayout, split_evenly

SMOLLM = dict(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)


def layouts(tp: int, **sizes) -> list[ShardLayout]:
    return [ShardLayout(rank, tp, **{**SMOLLM, **sizes}) for rank in range(tp)]


def test_split_evenly_puts_the_larger_runs_first():
    assert [split_evenly(10, 4, i) for i in range(4)] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert [split_evenly(3, 3, i) for i in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]


def test_smollm_at_tp2_splits_kv_heads_unevenly_with_their_query_groups():
    r0, r1 = layouts(2)
    assert (r0.kv_heads(), r0.q_heads()) == (range(0, 2), range(0, 6))
    assert (r1.kv_heads(), r1.q_heads()) == (range(2, 3), range(6, 9))
    assert (r0.mlp_columns(), r1.mlp_columns()) == (range(0, 768), range(768, 1536))
    assert (r0.vocab_rows(), r1.vocab_rows()) == (range(0, 24576), range(24576, 49152))
    assert [r0.kv_owner(h) for h in range(3)] == [0, 0, 1]


def test_every_head_column_and_row_is_owned_exactly_once_without_replication():
    for tp in (1, 2, 3):
        ranks = layouts(tp)
        assert sorted(h for r in ranks for h in r.q_heads()) == list(range(9))
        assert sorted(h for r in ranks for h in r.kv_heads()) == list(range(3))
        assert sorted(c for r in ranks for c in r.mlp_columns()) == list(range(1536))
        assert sum(len(r.vocab_rows()) for r in ranks) == 49152


def test_more_ranks_than_kv_heads_replicates_each_kv_head_and_splits_its_queries():
    # 8 query heads over 2 KV heads (groups of 4) on 4 ranks: each KV head on two ranks.
    ranks = layouts(4, num_heads=8, num_kv_heads=2)
    assert [r.kv_heads() for r in ranks] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [r.q_heads() for r in ranks] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert ranks[0].replicas == 2
    assert [ranks[0].kv_owner(h) for h in range(2)] == [0, 2]
    # SmolLM's 3 KV heads on 6 ranks: groups of 3 query heads split 2 + 1.
    six = layouts(6)
    assert [r.q_heads() for r in six[:2]] == [range(0, 2), range(2, 3)]


@pytest.mark.parametrize(("tp", "sizes", "message"), [
    (4, {}, "tensor_parallel_size 4 exceeds num_kv_heads 3 and is not a multiple of it"),
    (12, {}, "tensor_parallel_size 12 exceeds num_heads 9"),
    (2, {"num_heads": 8, "num_kv_heads": 3}, "num_heads 8 is not a multiple of num_kv_heads 3"),
])
def test_unshardable_sizes_are_refused_with_the_sizes(tp, sizes, message):
    with pytest.raises(ValueError, match=message):
        ShardLayout(0, tp, **{**SMOLLM, **sizes})


def test_rank_outside_the_group_is_refused():
    with pytest.raises(ValueError, match="rank 2 outside tensor_parallel_size 2"):
        ShardLayout(2, 2, **SMOLLM)
