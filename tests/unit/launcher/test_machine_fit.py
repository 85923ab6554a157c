"""`tandem up` refuses a cluster that does not fit the machine before it starts anything, and a
values file starts from tandem up's own sizes: the out-of-memory start of a values file with a GPU
cluster's sizes, a silently substituted model, and the numbers behind each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

import tandem_cli.main
from launcher import machine_fit
from launcher.config import ClusterConfig
from launcher.machine_fit import GIB, MIB, PROCESS_BYTES, check, cluster_needs, size
from launcher.model_shape import ModelShape
from launcher.ports import free_port
from tandem_cli.values import MAPPING, READS, load_values, sets, up_options

ROOT = Path(__file__).resolve().parents[3]
LOCAL_VALUES = ROOT / "deploy" / "k8s" / "helm" / "values-local.yaml"
# SmolLM2-135M-Instruct: 134,515,008 parameters, 30 layers, 3 KV heads of 64 (its config.json).
SMOLLM2 = ModelShape(134_515_008, 30, 3, 64, 8192)
BLOCK_BYTES = 16 * 2 * 30 * 3 * 64 * 4  # 737,280: one float32 block of 16 tokens
# The values file, made explicit: the chart's sizes for a GPU cluster, on a laptop.
CHART_SIZES = """\
model: {name: foo}
router: {replicas: 2}
prefill: {replicas: 2, numKvBlocks: 4096}
decode: {replicas: 2, numKvBlocks: 16384}
kvPool: {dram: 16Gi, nvme: {type: emptyDir, size: 100Gi}}
"""


def up(*args: str, available: int | None = None, monkeypatch=None):
    if available is not None:
        monkeypatch.setattr(machine_fit, "available_memory_bytes", lambda: available)
    return CliRunner().invoke(tandem_cli.main.main, ["up", *args], terminal_width=200)


def ports() -> list[str]:
    return ["--http-port", str(free_port()), "--grpc-port", str(free_port())]


def test_the_shape_gives_weights_and_block_bytes() -> None:
    assert SMOLLM2.weight_bytes("float32") == 538_060_032 and SMOLLM2.weight_bytes("bfloat16") == 269_030_016
    assert SMOLLM2.kv_block_bytes(16, "float32") == BLOCK_BYTES == 720 * 1024
    # 8-bit KV: one byte per value and a float32 scale per (token, head) row, as KVCacheSpec counts it
    assert SMOLLM2.kv_block_bytes(16, "float32", "fp8") == SMOLLM2.kv_block_bytes(16, "bfloat16", "int8") == 195_840


def test_an_8bit_kv_cache_is_counted_at_its_own_block_size() -> None:
    config = ClusterConfig.from_options(model="m", num_kv_blocks=1024, kv_cache_dtype="fp8")
    needs = {n.name: n for n in cluster_needs(config, SMOLLM2)}
    assert dict(needs["decode workers"].parts)["KV cache (1024 blocks x 191.2 KiB)"] == 1024 * 195_840
    assert "--kv-cache-dtype fp8" in needs["decode workers"].flags


def test_each_process_is_counted_with_weights_kv_arena_and_its_own_memory() -> None:
    config = ClusterConfig.from_options(model="m", num_kv_blocks=1024, prefill_num_kv_blocks=512,
                                        pool_capacity_bytes=2 * GIB, num_decode_workers=2, decode_tp=2)
    needs = {n.name: n for n in cluster_needs(config, SMOLLM2)}
    assert list(needs) == ["prefill workers", "decode worker ranks", "KV pool nodes", "routers", "Redis"]
    prefill = needs["prefill workers"]  # the weights and, with --linear-backend auto, two GEMM copies of them
    assert (prefill.count, prefill.each_bytes) == (1, 3 * 538_060_032 + 512 * BLOCK_BYTES + PROCESS_BYTES["worker"])
    decode = needs["decode worker ranks"]  # 2 workers x 2 ranks, each rank half the weights and blocks
    assert (decode.count, decode.each_bytes) == (4, 3 * (538_060_032 // 2) + 1024 * BLOCK_BYTES // 2 + 768 * MIB)
    assert needs["KV pool nodes"].each_bytes == 2 * GIB + 64 * MIB and needs["routers"].each_bytes == 384 * MIB
    fit = check(config, SMOLLM2, available_bytes=64 * GIB)
    assert fit.memory_bytes == sum(n.count * n.each_bytes for n in needs.values()) and fit.problems() == []
    on_gpu = {n.name: n for n in cluster_needs(config, SMOLLM2, workers_on_gpu=True)}
    assert on_gpu["decode worker ranks"].each_bytes == PROCESS_BYTES["worker"]  # weights and KV on the GPU


@pytest.mark.parametrize("linear_backend, quantization, copy_bytes", [
    ("auto", "none", 2 * 538_060_032),  # oneDNN's reordered copy and Tandem's packed one
    ("onednn", "none", 538_060_032),
    ("torch", "none", 0),  # F.linear reads the weights themselves
    ("auto", "int8", 2 * (538_060_032 // 4)),  # copies of the int8 weights
])
def test_a_cpu_worker_counts_the_gemm_copies_its_linear_backend_prepares(linear_backend, quantization,
                                                                         copy_bytes) -> None:
    config = ClusterConfig.from_options(model="m", num_kv_blocks=1024, linear_backend=linear_backend,
                                        quantization=quantization)
    decode = {n.name: n for n in cluster_needs(config, SMOLLM2)}["decode workers"]
    copies = {what: n for what, n in decode.parts if what.startswith("GEMM copies")}
    assert sum(copies.values()) == copy_bytes
    assert decode.each_bytes == 538_060_032 + copy_bytes + 1024 * BLOCK_BYTES + PROCESS_BYTES["worker"]
    assert f"--linear-backend {linear_backend}" in decode.flags
    on_gpu = {n.name: n for n in cluster_needs(config, SMOLLM2, workers_on_gpu=True)}["decode workers"]
    assert on_gpu.each_bytes == PROCESS_BYTES["worker"]  # a GPU worker's copies live in GPU memory


def test_a_cluster_beyond_the_memory_is_refused_naming_the_options_that_size_it() -> None:
    config = ClusterConfig.from_options(model="m", num_kv_blocks=16384, num_decode_workers=2,
                                        pool_capacity_bytes=8 * GIB)
    fit = check(config, SMOLLM2, available_bytes=16 * GIB)
    assert fit.problems() == [f"memory: the processes will take {size(fit.memory_bytes)}; this machine has 16.0 GiB "
                              "available (90% of it: 14.4 GiB)"]
    message = fit.message()
    assert message.startswith("this cluster does not fit this machine:\n  memory: ")
    assert ("decode workers: 2 x 13.5 GiB (weights 513.1 MiB + GEMM copies (2 x weights, --linear-backend auto) "
            "1.0 GiB + KV cache (16384 blocks x 720.0 KiB) 11.2 GiB + process 768.0 MiB)  [--num-decode-workers 2, "
            "--num-kv-blocks 16384, --block-size 16, --dtype float32, --linear-backend auto]") in message
    assert "KV pool nodes: 1 x 8.1 GiB (DRAM arena 8.0 GiB + process 64.0 MiB)" in message
    assert message.endswith("or pass --force to start anyway")


def test_an_nvme_tier_beyond_the_disk_is_refused(tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    config = ClusterConfig.from_options(model="m", pool_nvme_path=str(tmp_path / "nvme"),
                                        pool_nvme_capacity_bytes=free + GIB)
    fit = check(config, SMOLLM2, available_bytes=64 * GIB)
    assert fit.nvme_bytes == free + GIB
    assert [p.split(";")[0] for p in fit.problems()] == [
        f"disk: the NVMe tier takes {size(free + GIB)} in {tmp_path / 'nvme'}"]


def test_the_smallest_values_file_in_the_docs_fits_a_laptop(monkeypatch) -> None:
    """values-local.yaml (docs/deploy.md) with the real model: within 90 % of the 8 GiB a 16 GiB
    laptop has free."""
    result = up("-f", str(LOCAL_VALUES), "--print-config", available=8 * GIB, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    comments = [line for line in result.output.splitlines() if line.startswith("#")]
    assert comments[0] == "# this machine: fits"
    assert "# total 6.9 GiB of memory; available 8.0 GiB (plans up to 7.2 GiB)" in comments


def test_the_chart_sized_values_file_is_refused_before_anything_starts(tmp_path: Path, monkeypatch) -> None:
    values = tmp_path / "my-values.yaml"
    values.write_text(CHART_SIZES)
    logs = tmp_path / "logs"
    result = up("-f", str(values), *ports(), "--log-dir", str(logs), available=16 * GIB, monkeypatch=monkeypatch)
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert lines[0] == "Error: this cluster does not fit this machine:"
    assert lines[1].startswith("  memory: the processes will take 51.6 GiB; this machine has 16.0 GiB available")
    assert any(line.startswith("  decode workers: 2 x 13.5 GiB") and "--num-kv-blocks 16384" in line for line in lines)
    assert not logs.exists()  # nothing started, no log opened


def test_force_starts_what_does_not_fit(tmp_path: Path, monkeypatch) -> None:
    """Past the check the launcher prepares the model: stopped there, before any service starts."""
    import engine.model.gguf_convert as gguf_convert

    def prepared(_source):
        raise RuntimeError("the model is prepared: the fit check let it through")

    monkeypatch.setattr(gguf_convert, "ensure_hf_dir", prepared)
    values = tmp_path / "my-values.yaml"
    values.write_text(CHART_SIZES)
    result = up("-f", str(values), *ports(), "--log-dir", str(tmp_path / "logs"), "--force", available=16 * GIB,
                monkeypatch=monkeypatch)
    assert str(result.exception) == "the model is prepared: the fit check let it through"


def test_print_config_shows_the_sums_and_the_verdict(tmp_path: Path, monkeypatch) -> None:
    values = tmp_path / "my-values.yaml"
    values.write_text(CHART_SIZES)
    result = up("-f", str(values), "--print-config", available=16 * GIB, monkeypatch=monkeypatch)
    assert result.exit_code == 0, result.output
    comments = [line for line in result.output.splitlines() if line.startswith("#")]
    assert comments[0].startswith("# this machine: memory: the processes will take 51.6 GiB")
    assert "# total 51.6 GiB of memory; available 16.0 GiB (plans up to 14.4 GiB)" in comments


def test_a_values_file_keeps_tandem_ups_sizes_where_it_says_nothing(tmp_path: Path) -> None:
    values = tmp_path / "name-only.yaml"
    values.write_text("model: {name: foo}\n")
    result = CliRunner().invoke(tandem_cli.main.main, ["up", "-f", str(values), "--print-config"])
    assert result.exit_code == 0, result.output
    options = __import__("yaml").safe_load(result.output)["options"]
    assert options["served_model_name"] == {"value": "foo", "from": "values file"}
    for name, value in (("num_routers", 1), ("num_prefill_workers", 1), ("num_decode_workers", 1),
                        ("num_kv_blocks", 1024), ("pool_capacity_bytes", 2 * GIB), ("pool_nvme_path", ""),
                        ("model", "SmolLM2-135M-Instruct")):
        assert options[name] == {"value": value, "from": "default"}, name


def test_every_mapped_option_says_which_values_it_reads() -> None:
    assert set(READS) == set(MAPPING)
    merged = load_values(LOCAL_VALUES)
    assert up_options(merged, {"decode": {"numKvBlocks": 7}}) == {"num_kv_blocks": 1024}  # merged value, file's key
    assert sets({"kvPool": {"nvme": {"type": "none"}}}, "kvPool.nvme") and not sets({"kvPool": {}}, "kvPool.nvme")


def hf_cache(monkeypatch, folder: Path) -> None:
    """Makes ``folder`` the Hugging Face cache (huggingface_hub reads it at each call)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(folder))


def test_a_hugging_face_source_that_is_not_here_is_an_error_not_another_model(tmp_path: Path, monkeypatch) -> None:
    hf_cache(monkeypatch, tmp_path / "empty-hf-cache")
    values = tmp_path / "hf.yaml"
    values.write_text("model: {name: foo, source: {type: huggingface, huggingface: {repo: acme/none-such}}}\n")
    result = CliRunner().invoke(tandem_cli.main.main, ["up", "-f", str(values), "--print-config"], terminal_width=400)
    assert result.exit_code == 2
    assert result.output.splitlines()[-1] == (
        "Error: the values file's model.source is the Hugging Face repo acme/none-such (revision main), which is not "
        "in this machine's Hugging Face cache, and tandem up downloads nothing: fetch it first (hf download "
        "acme/none-such --revision main) or pass --model with its folder")
    given = CliRunner().invoke(tandem_cli.main.main, ["up", "-f", str(values), "--model", "SmolLM2-135M-Instruct",
                                                   "--print-config"])
    assert given.exit_code == 0, given.output  # --model says where it is on this machine
    pvc = tmp_path / "pvc.yaml"
    pvc.write_text("model: {source: {type: pvc, pvc: {claimName: models}, path: smollm2}}\n")
    result = CliRunner().invoke(tandem_cli.main.main, ["up", "-f", str(pvc), "--print-config"], terminal_width=400)
    assert result.output.splitlines()[-1] == (
        "Error: the values file's model.source is a pvc volume, which only exists on Kubernetes: pass --model with "
        "the model's folder or .gguf file on this machine")


def test_a_hugging_face_source_in_the_local_cache_is_served(tmp_path: Path, monkeypatch) -> None:
    """A repo in the Hugging Face cache layout (refs/main -> a snapshot folder) becomes --model."""
    cache = tmp_path / "hf"
    snapshot = cache / "models--acme--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (cache / "models--acme--tiny" / "refs").mkdir()
    (cache / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    hf_cache(monkeypatch, cache)
    from tandem_cli.values import model_source_problem

    values = {"model": {"source": {"type": "huggingface", "huggingface": {"repo": "acme/tiny", "revision": "main"}}}}
    assert model_source_problem(values) is None
    assert up_options(values, {"model": {"source": {}}}) == {"model": str(snapshot)}


def test_max_model_len_beyond_the_model_is_refused_by_print_config_too(monkeypatch) -> None:
    from launcher import model_shape

    monkeypatch.setattr(model_shape, "read_shape", lambda source: SMOLLM2)
    result = CliRunner().invoke(tandem_cli.main.main, ["up", "--max-model-len", "9000", "--num-kv-blocks", "1024",
                                                    "--print-config"], terminal_width=200)
    assert (result.exit_code, result.output) == (
        1, "Error: --max-model-len 9000 exceeds the model's max_position_embeddings (8192); pass --max-model-len "
           "8192 or less\n")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_shape_from_a_hugging_face_folder(tmp_path: Path, dtype: str) -> None:
    """Parameters from the safetensors headers equal transformers' count and the config's sum."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from launcher.model_shape import _llama_params

    config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(tmp_path)
    shape = ModelShape.from_hf_dir(tmp_path)
    params = sum(p.numel() for p in model.parameters())
    assert shape == ModelShape(params, 2, 2, 16, 256)
    assert _llama_params(json.loads((tmp_path / "config.json").read_text()), 16, 2) == params
