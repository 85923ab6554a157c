"""Prefix synthesis: k shared leading hash ids -> exactly k x block identical leading tokens."""

import pytest

from bench.synthesis import PrefixSynthesizer, SynthesisConfig
from bench.traces import TraceRow
from bench.workloads import WorkloadConfig, load_workload
from tests.unit.bench.test_traces import DATA


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def row(hash_ids, blocks_tokens):
    return TraceRow(0.0, blocks_tokens, 1, tuple(hash_ids))


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_k_shared_hash_ids_share_exactly_k_blocks(k):
    config = SynthesisConfig(length_scale=1 / 32, seed=7)  # 16-token blocks
    synth = PrefixSynthesizer(config)
    a_ids = [10, 11, 12, 13][:k] + [100, 101]
    b_ids = [10, 11, 12, 13][:k] + [200, 201]
    a = synth.prompt(row(a_ids, 512 * len(a_ids)), 0)
    b = synth.prompt(row(b_ids, 512 * len(b_ids)), 1)
    assert len(a) == len(b) == 16 * (k + 2)
    assert common_prefix(a, b) == k * 16


def test_sibling_blocks_differ_at_their_first_token_even_with_colliding_randomness():
    # Same hash id seeds the same random tail; siblings still differ at token 0 of the block.
    synth = PrefixSynthesizer(SynthesisConfig(length_scale=1 / 512, token_low=5, token_high=7))  # 1-token blocks
    a = synth.prompt(row([0, 1], 1024), 0)
    b = synth.prompt(row([0, 2], 1024), 1)
    assert a[0] == b[0] and a[1] != b[1]
    with pytest.raises(ValueError, match="widen the token range"):
        synth.prompt(row([0, 3], 1024), 2)  # a third sibling: only 2 token ids to tell them apart


def test_partial_last_block_is_a_prefix_of_the_full_block_and_lengths_scale_up():
    config = SynthesisConfig(length_scale=1 / 32)
    synth = PrefixSynthesizer(config)
    full = synth.prompt(row([0, 1], 1024), 0)
    partial = synth.prompt(row([0, 1], 513), 1)  # ceil(513 / 32) = 17 tokens: one block + 1
    assert len(partial) == 17
    assert partial == full[:17]
    assert config.scale_output(500) == 16  # ceil(15.625)


def test_length_scale_must_make_a_whole_block():
    with pytest.raises(ValueError, match="whole number of tokens"):
        SynthesisConfig(length_scale=0.3)


def test_mooncake_workload_rows_67_and_134_share_five_scaled_blocks():
    config = WorkloadConfig("mooncake", DATA / "mooncake_conversation_slice.jsonl",
                            synthesis=SynthesisConfig(length_scale=1 / 32))
    requests = load_workload(config)
    assert [len(r.prompt) for r in requests] == [-(-n // 32) for n in (6758, 7322, 7236, 2290, 6760, 2651, 3024)]
    assert requests[0].max_tokens == 16  # ceil(500 / 32)
    # Every row starts with hash id 0; rows 67 and 134 of the trace share 5 blocks.
    assert common_prefix(requests[0].prompt, requests[1].prompt) == 16
    assert common_prefix(requests[5].prompt, requests[6].prompt) == 5 * 16
    assert requests[5].arrival_s == 21.0


def test_rows_without_hash_ids_get_distinct_random_prompts_of_exact_length():
    requests = load_workload(WorkloadConfig("azure", DATA / "azure_code_slice.csv", num_requests=3,
                                            synthesis=SynthesisConfig(length_scale=1 / 16)))
    assert [len(r.prompt) for r in requests] == [301, 199, 7]  # ceil(4808/16), ceil(3180/16), ceil(110/16)
    assert requests[0].prompt != requests[1].prompt[: len(requests[0].prompt)]
    assert all(1000 <= t < 30000 for r in requests for t in r.prompt)


def test_max_total_tokens_skips_long_rows_and_max_tokens_overrides_outputs():
    requests = load_workload(WorkloadConfig("burstgpt", DATA / "burstgpt_1_slice.csv", max_tokens=5,
                                            max_total_tokens=300))
    assert all(len(r.prompt) + r.max_tokens <= 300 for r in requests)
    assert {r.max_tokens for r in requests} == {5}
    assert 0 < len(requests) < 20
