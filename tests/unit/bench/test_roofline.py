"""Roofline arithmetic: footprint from a HF folder, the bound, and the step/bound ratio."""

import json

import pytest

from bench.roofline import ModelFootprint, copy_bandwidth_bytes_per_s, decode_bound_s, report

SMOLLM2_CONFIG = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
                  "head_dim": 64}


def test_footprint_of_smollm2_shapes(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    footprint = ModelFootprint.from_hf_dir(tmp_path)
    assert footprint.kv_bytes_per_token == 46_080  # 2 x 30 x 3 x 64 x 4 B
    assert footprint.weight_bytes == 1000
    fp8 = ModelFootprint.from_hf_dir(tmp_path, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token == 12_240  # 2 x 30 x 3 x (64 one-byte values + a 4-byte scale)


def test_bound_adds_kv_of_the_whole_batch():
    footprint = ModelFootprint(weight_bytes=538_000_000, kv_bytes_per_token=46_080)
    # 538 MB + 8 x 200 x 46,080 B = 611.728 MB at 20 GB/s -> 30.5864 ms
    assert decode_bound_s(footprint, 8, 200, 20e9) == pytest.approx(0.0305864)
    entry = report(footprint, 20e9, 8, 200, measured_step_s=0.0611728)
    assert entry["step_over_bound"] == pytest.approx(2.0)
    assert entry["bound_ms"] == pytest.approx(30.5864)


def test_copy_probe_returns_a_plausible_bandwidth():
    bandwidth = copy_bandwidth_bytes_per_s(buffer_bytes=16 * 1024**2, repeats=3)
    assert 1e8 < bandwidth < 1e13
