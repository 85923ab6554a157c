"""bench.hf_baseline.static_records on a hand-made run_static result (no model)."""

import pytest

from bench.hf_baseline import static_records
from bench.metrics import SLO, summarize


def test_static_batches_become_closed_loop_records():
    # two batches of 2; batch 1 starts when batch 0 ends (at 3.0 s)
    result = {"batches": [{"first_prompt": 0, "num_prompts": 2, "start_s": 0.0, "token_times_s": [1.0, 1.5, 3.0]},
                          {"first_prompt": 2, "num_prompts": 2, "start_s": 3.0, "token_times_s": [3.5, 3.7, 3.9]}]}
    records = static_records(result, [[1] * 5, [1] * 7, [1] * 2, [1] * 3])
    assert [r.index for r in records] == [0, 1, 2, 3]
    assert [r.start_s for r in records] == [0.0, 0.0, 3.0, 3.0]
    assert records[0].ttft_s == 1.0 and records[0].gaps_s == [0.5, 1.5]  # TTFT: the batch's prefill
    assert records[2].ttft_s == pytest.approx(0.5) and records[2].e2e_s == pytest.approx(0.9)
    assert [r.prompt_tokens for r in records] == [5, 7, 2, 3] and records[3].output_tokens == 3
    s = summarize(records, 3.9, SLO(ttft_ms=800, tbt_ms=1000))
    assert s["goodput_rps"] == pytest.approx(2 / 3.9)  # batch 0 misses the 800 ms TTFT, batch 1 meets both
