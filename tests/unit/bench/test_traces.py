"""Trace parsers on the slices in tests/data (values checked by hand against the files)."""

from pathlib import Path

import pytest

from bench.traces import read_azure, read_burstgpt, read_mooncake, read_trace

DATA = Path(__file__).resolve().parents[2] / "data"


def test_mooncake_rows_keep_lengths_hashes_and_ms_timestamps():
    rows = read_mooncake(DATA / "mooncake_conversation_slice.jsonl")
    assert len(rows) == 7
    assert (rows[0].input_tokens, rows[0].output_tokens) == (6758, 500)
    assert rows[0].hash_ids == tuple(range(14))
    assert rows[3].hash_ids == (0, 42, 43, 44, 45)
    assert [r.arrival_s for r in rows[4:]] == [0.0, 21.0, 48.0]  # 21000 ms, 48000 ms


def test_mooncake_rejects_hash_ids_that_do_not_cover_the_input(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}\n')
    with pytest.raises(ValueError, match="expected 2"):
        read_mooncake(bad)


def test_azure_timestamps_become_relative_seconds_with_seven_digit_fractions():
    rows = read_azure(DATA / "azure_code_slice.csv")
    assert [(r.input_tokens, r.output_tokens) for r in rows[:2]] == [(4808, 10), (3180, 8)]
    assert rows[0].arrival_s == 0.0
    assert rows[1].arrival_s == pytest.approx(0.052, abs=1e-6)  # 04.0319600 - 03.9799600
    assert rows[4].arrival_s == pytest.approx(0.444994, abs=1e-6)
    assert all(r.hash_ids == () for r in rows)


def test_burstgpt_drops_zero_token_failures_unless_asked():
    rows = read_burstgpt(DATA / "burstgpt_1_slice.csv")
    assert len(rows) == 20  # 21 rows, the last is a 0/0 failure
    assert (rows[0].input_tokens, rows[0].output_tokens, rows[0].arrival_s) == (472, 18, 0.0)
    assert rows[1].arrival_s == 40.0  # timestamps 5 and 45
    assert len(read_burstgpt(DATA / "burstgpt_1_slice.csv", keep_failures=True)) == 21


def test_burstgpt_session_layout_reads_the_same_columns():
    rows = read_trace(DATA / "burstgpt_3_slice.csv", "burstgpt")
    assert (rows[0].input_tokens, rows[0].output_tokens) == (906, 446)
    assert rows[1].arrival_s == 51.0  # 19440161.0 - 19440110.0


def test_unknown_trace_kind_is_refused():
    with pytest.raises(ValueError, match="unknown trace kind 'csv'"):
        read_trace(DATA / "azure_code_slice.csv", "csv")
