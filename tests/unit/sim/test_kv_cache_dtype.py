"""``--kv-cache-dtype`` in the simulator: 8-bit KV rows (head_dim bytes + a float32 scale) in the
transfers, the pool's and the GPUs' blocks and the attention reads, and on the command lines."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from sim.cli import plan, sim
from sim.cluster import DEFAULT_POOL_BLOCKS, RouterSpec
from sim.hardware import GPUS, MODELS, Roofline, StepFeatures
from sim.setup import ClusterChoice, build_cluster, build_worker, kv_footprint, pool_capacity_blocks
from sim.simulator import Simulation
from sim.workload import load_trace

DATA = Path(__file__).parents[2] / "data"
SLICE = DATA / "mooncake_conversation_slice.jsonl"
LLAMA_8B_BF16 = 2 * 32 * 8 * 128 * 2  # 131,072: a 256-byte row per (token, KV head), K and V, 32 layers
LLAMA_8B_FP8 = 2 * 32 * 8 * (128 + 4)  # 67,584: 128 one-byte values + their float32 scale


def test_model_kv_bytes_per_token_count_the_8bit_rows_and_their_scales():
    llama, smollm = MODELS["llama-3.1-8b"], MODELS["smollm2-135m"]
    assert llama.kv_bytes_per_token == LLAMA_8B_BF16 == 131_072
    fp8, int8 = (dataclasses.replace(llama, kv_cache_dtype=kv) for kv in ("fp8", "int8"))
    assert fp8.kv_bytes_per_token == int8.kv_bytes_per_token == LLAMA_8B_FP8 == 67_584
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64: a 128-byte bf16 row, a 68-byte 8-bit one
    assert smollm.kv_bytes_per_token == 23_040
    assert dataclasses.replace(smollm, kv_cache_dtype="fp8").kv_bytes_per_token == 2 * 30 * 3 * 68 == 12_240
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of .*, got 'fp16'"):
        dataclasses.replace(llama, kv_cache_dtype="fp16")


def test_fp8_workers_hold_more_blocks_and_move_and_read_fewer_bytes():
    bf16 = build_worker(ClusterChoice(1, 1, block_size=128), 1)
    fp8 = build_worker(ClusterChoice(1, 1, block_size=128, kv_cache_dtype="fp8"), 1)
    assert (bf16.kv_bytes_per_token, fp8.kv_bytes_per_token) == (131_072, 67_584)
    assert bf16.cost.kv_bytes_per_token == 131_072 and fp8.cost.kv_bytes_per_token == 67_584  # what the router reads
    # 90 % of an H200's 141 GiB beside 16.06 GB of bf16 weights: 120.2 GB of 16 MiB or 8.25 MiB blocks
    assert (bf16.engine.num_kv_blocks, fp8.engine.num_kv_blocks) == (7164, 13_894)
    # a 12,000-token prompt's KV over one 400 Gb/s NIC: 1.57 GB in 31.5 ms, 0.81 GB in 16.2 ms
    assert bf16.transfer_s(12_000) == 12_000 * 131_072 / 50e9 == 0.03145728
    assert fp8.transfer_s(12_000) == 12_000 * 67_584 / 50e9 == 0.01622016
    assert fp8.transfer_s(12_000) / bf16.transfer_s(12_000) == pytest.approx(33 / 64, abs=1e-15)  # 132 / 256
    # decode at 1000 tokens of context: the weights plus the context's KV rows from HBM
    h200 = GPUS["H200"]
    decode = StepFeatures(1, 1, 1.0, 1000)
    assert Roofline(h200, MODELS["llama-3.1-8b"]).step_s(decode) == 0.002 + (8.03e9 * 2 + 131_072_000) / (4.8e12 * 0.8)
    fp8_model = dataclasses.replace(MODELS["llama-3.1-8b"], kv_cache_dtype="fp8")
    assert Roofline(h200, fp8_model).step_s(decode) == 0.002 + (8.03e9 * 2 + 67_584_000) / (4.8e12 * 0.8)


def test_the_pool_holds_its_bytes_over_a_block_of_the_kv_cache_dtype():
    four_tib = 4 * 2**40
    bf16 = ClusterChoice(1, 1, block_size=128, pool_capacity_bytes=four_tib)
    fp8 = dataclasses.replace(bf16, kv_cache_dtype="fp8")
    assert pool_capacity_blocks(bf16, build_worker(bf16, 1)) == four_tib // (128 * 131_072) == 262_144
    assert pool_capacity_blocks(fp8, build_worker(fp8, 1)) == four_tib // (128 * 67_584) == 508_400
    assert build_cluster(fp8).pool_capacity_blocks == 508_400
    unbounded = ClusterChoice(1, 1)
    assert pool_capacity_blocks(unbounded, build_worker(unbounded, 1)) == DEFAULT_POOL_BLOCKS == 4_194_304
    tiny = ClusterChoice(1, 1, block_size=128, pool_capacity_bytes=2**20)
    with pytest.raises(ValueError, match="--pool-capacity-bytes 1048576 holds no block of 16777216 bytes"):
        build_cluster(tiny)
    assert kv_footprint(fp8, build_worker(fp8, 1), 12_000.0) == {
        "kv_cache_dtype": "fp8", "kv_bytes_per_token": 67_584, "block_bytes": 8_650_752, "num_kv_blocks": 13_894,
        "pool_capacity_bytes": four_tib, "pool_capacity_blocks": 508_400, "mean_prompt_tokens": 12_000.0,
        "mean_prompt_kv_bytes": 811_008_000.0, "mean_prompt_transfer_s": 0.01622016}


def test_the_same_pool_bytes_keep_a_prefix_in_fp8_that_bf16_evicts(tmp_path):
    """The slice's last two rows share 2560 tokens (20 blocks of 128): the first stores its 20
    full blocks, the second (23 full blocks) reads them back. A pool of 19 bf16 blocks' bytes has
    evicted the chain's first block by then, and a chain is read from its start; the same bytes
    hold 36 fp8 blocks."""
    rows = SLICE.read_text().splitlines()[5:]
    trace = tmp_path / "two.jsonl"
    trace.write_text("\n".join(rows) + "\n")
    requests = load_trace(trace, "mooncake")
    rates = {}
    for kv in ("auto", "fp8"):
        choice = ClusterChoice(1, 1, block_size=128, router=RouterSpec(disaggregation="always"),
                               pool_capacity_bytes=19 * 128 * 131_072, kv_cache_dtype=kv)
        cluster = build_cluster(choice)
        rates[kv] = (cluster.pool_capacity_blocks, Simulation(cluster).run(requests).pool_hit_rate)
    assert rates == {"auto": (19, 0 / 43), "fp8": (36, 20 / 43)}


def test_sim_takes_the_kv_cache_dtype_and_a_pool_size_and_reports_them(tmp_path):
    result = CliRunner().invoke(sim, ["--path", str(SLICE), "--kv-cache-dtype", "int8", "--block-size", "128",
                                      "--pool-capacity-bytes", "4TiB", "--out", str(tmp_path), "--no-plots"],
                                terminal_width=400)
    assert result.exit_code == 0, result.output
    kv = json.loads((tmp_path / "sim.json").read_text())["settings"]["kv"]
    mean_prompt = (6758 + 7322 + 7236 + 2290 + 6760 + 2651 + 3024) / 7
    assert kv == {"kv_cache_dtype": "int8", "kv_bytes_per_token": 67_584, "block_bytes": 8_650_752,
                  "num_kv_blocks": 13_894, "pool_capacity_bytes": 4 * 2**40, "pool_capacity_blocks": 508_400,
                  "mean_prompt_tokens": mean_prompt, "mean_prompt_kv_bytes": mean_prompt * 67_584,
                  "mean_prompt_transfer_s": 5149 * 67_584 / 50e9}
    assert ("KV int8: 67,584 B per token, 8.25 MiB per block; 13,894 blocks per worker; pool 508,400 blocks (4.00 TiB); "
            "a mean prompt (5,149 tokens) is 0.35 GB of KV, 7.0 ms per hop on a worker's NIC") in result.output


@pytest.mark.parametrize("command", [sim, plan])
def test_a_kv_cache_dtype_the_workers_do_not_take_is_a_usage_error(command, tmp_path):
    result = CliRunner().invoke(command, ["--path", str(SLICE), "--kv-cache-dtype", "fp16", "--out", str(tmp_path)],
                                terminal_width=400)
    assert result.exit_code == 2
    assert ("Error: Invalid value for '--kv-cache-dtype': 'fp16' is not one of 'auto', 'fp8', 'int8'."
            in result.output)


def test_a_fitted_cost_model_keeps_its_own_kv_bytes(tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"base_s": 0.01, "per_token_s": 1e-4, "per_seq_s": 1e-3, "per_attn_s": 0.0,
                                "num_samples": 64, "max_num_batched_tokens": 512, "kv_load_bytes_per_s": 1e9,
                                "kv_bytes_per_token": 23_040}))
    result = CliRunner().invoke(sim, ["--path", str(SLICE), "--cost-model", str(cost), "--num-kv-blocks", "64",
                                      "--max-model-len", "8192", "--kv-cache-dtype", "fp8", "--out", str(tmp_path)],
                                terminal_width=400)
    assert result.exit_code == 2
    assert ("--kv-cache-dtype fp8 times roofline workers; a fitted cost model carries its worker's own KV bytes per "
            "token (fit it on a worker run with --kv-cache-dtype fp8)") in result.output


def test_plan_with_fp8_kv_writes_helm_values_of_fp8_blocks(tmp_path):
    values = tmp_path / "values.yaml"
    result = CliRunner().invoke(plan, ["--path", str(SLICE), "--gpus", "2", "--time-scale", "0.01", "--kv-cache-dtype",
                                       "fp8", "--out", str(tmp_path), "--helm-values", str(values), "--jobs", "1"],
                                terminal_width=400)
    assert result.exit_code == 0, result.output
    assert "plan: 7 requests, KV fp8, SLO TTFT 2000 ms" in result.output
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["settings"]["kv"]["kv_bytes_per_token"] == 67_584
    assert data["settings"]["kv"]["num_kv_blocks"] == 13_894
    overrides = yaml.safe_load(values.read_text())
    assert overrides["engine"]["kvCacheDtype"] == "fp8"
    assert overrides["decode"]["numKvBlocks"] == 13_894  # the fp8 blocks that fit, deployed as fp8
