"""Lazy trace prompts, the roofline, and ``tandem sim`` end to end on the test slice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.block_hash import hash_block_chain
from sim.cli import sim
from sim.hardware import GPUS, MODELS, Roofline, StepFeatures
from sim.workload import TracePrompt, load_trace

DATA = Path(__file__).parents[2] / "data"


def test_trace_prompts_share_exactly_their_common_hash_id_prefix():
    a = TracePrompt((7, 8, 9), 4, 10)
    b = TracePrompt((7, 8, 5), 4, 12)
    assert list(a) == [7, 1, 2, 3, 8, 1, 2, 3, 9, 1]
    assert a[2:7] == [2, 3, 8, 1, 2] and a[-1] == 1 and len(a) == 10
    hashes_a, hashes_b = hash_block_chain(list(a), 2), hash_block_chain(list(b), 2)
    assert hashes_a[:4] == hashes_b[:4] and hashes_a[4] != hashes_b[4]
    both = a + [42, 43]
    assert len(both) == 12 and both[8:12] == [9, 1, 42, 43] and list(both)[-2:] == [42, 43]
    with pytest.raises(ValueError, match="cannot hold"):
        TracePrompt((1,), 4, 5)


def test_load_trace_keeps_lengths_and_scales_time():
    rows = [json.loads(line) for line in (DATA / "mooncake_conversation_slice.jsonl").read_text().splitlines()]
    requests = load_trace(DATA / "mooncake_conversation_slice.jsonl", "mooncake", time_scale=0.5)
    assert [len(r.prompt) for r in requests] == [r["input_length"] for r in rows]
    assert [r.max_tokens for r in requests] == [r["output_length"] for r in rows]
    t0 = rows[0]["timestamp"]
    assert [r.arrival_s for r in requests] == pytest.approx([(r["timestamp"] - t0) / 1000 * 0.5 for r in rows])


def test_roofline_decode_is_bandwidth_bound_and_prefill_compute_bound():
    h200, model = GPUS["H200"], MODELS["llama-3.1-8b"]
    roof = Roofline(h200, model)
    decode = roof.step_s(StepFeatures(1, 1, 1.0, 1000))
    assert decode == pytest.approx(0.002 + (8.03e9 * 2 + 131072 * 1000) / (4.8e12 * 0.8))
    prefill = roof.step_s(StepFeatures(8192, 1, 8192 * 8192.5 / 2 / 1000, 8192))
    flops = 2 * 8.03e9 * 8192 + 4 * 32 * 32 * 128 * 8192 * 8192.5 / 2
    assert prefill == pytest.approx(0.002 + flops / (989e12 * 0.6))
    assert Roofline(GPUS["A100"], model).step_s(StepFeatures(1, 1, 1.0, 1000)) > decode  # less HBM bandwidth
    with pytest.raises(ValueError, match="raise tp"):
        Roofline(GPUS["L40S"], MODELS["llama-3.1-70b"]).num_kv_blocks(16)
    assert Roofline(GPUS["H100"], MODELS["llama-3.1-70b"], tp=4).num_kv_blocks(16) > 0


def test_sim_command_writes_bench_json_and_plots(tmp_path):
    result = CliRunner().invoke(sim, ["--path", str(DATA / "mooncake_conversation_slice.jsonl"), "--num-prefill", "1",
                                      "--num-decode", "2", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["summary"]["num_ok"] == data["summary"]["num_requests"] == 7
    assert len(data["records"]) == 7 and data["records"][0]["output_tokens"] == 500  # the slice's first row
    assert [w["role"] for w in data["sim"]["workers"]] == ["prefill", "decode", "decode"]
    assert (tmp_path / "cdfs.png").exists()


def test_sim_command_rejects_an_unknown_fit(tmp_path):
    bad = tmp_path / "cost.json"
    bad.write_text(json.dumps({"cost_num_samples": 0}))
    result = CliRunner().invoke(sim, ["--path", str(DATA / "mooncake_conversation_slice.jsonl"), "--cost-model", str(bad),
                                      "--num-kv-blocks", "64", "--max-model-len", "64", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "no fitted cost model" in result.output


def test_a_trace_without_its_file_is_a_one_line_usage_error_naming_where_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    result = CliRunner().invoke(sim, ["--num-requests", "200"], terminal_width=1000)
    assert result.exit_code == 2
    last = result.output.splitlines()[-1]
    assert last.startswith("Error: --workload mooncake needs --path FILE; get the Mooncake FAST'25 conversation "
                           "trace (12,031 requests, prefix hash chains of 512-token blocks): https://raw."
                           "githubusercontent.com/kvcache-ai/Mooncake/")
    assert f"saved as {tmp_path / 'mooncake_fast25_conversation_trace.jsonl'}" in last
    (tmp_path / "mooncake_fast25_conversation_trace.jsonl").write_text(
        (DATA / "mooncake_conversation_slice.jsonl").read_text())
    found = CliRunner().invoke(sim, ["--out", str(tmp_path / "out"), "--no-plots", "--time-scale", "0.01"])
    assert found.exit_code == 0, found.output  # the data folder's trace, without --path


def test_a_prompt_set_without_its_file_says_it_replays_the_built_in_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    result = CliRunner().invoke(sim, ["--workload", "sharegpt", "--rate", "2", "--max-tokens", "8", "--num-requests",
                                      "4", "--out", str(tmp_path / "out"), "--no-plots"], terminal_width=1000)
    assert result.exit_code == 0, result.output
    assert " ".join(result.output.split()).startswith(  # the note, wrapped at the console's width
        f"no --path and no sharegpt prompt set in {tmp_path}: the 8 built-in prompts, repeated (repeats hit the "
        "prefix cache: the numbers mean little); get the 500 ShareGPT V3 first-turn prompts")
