"""``--quantization fp8`` on a GPU, the sixth part of ``benchmarks/gpu_check.py`` (run by it, after
the tensor-parallel rows): ``torch._scaled_mm`` on SmolLM2's linear shapes against the CPU
reference, timed against bfloat16, and the engine with fp8 weights against HF's bfloat16 greedy
tokens. Below compute capability 8.9 one row says why it was skipped."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_check import Row, hf_greedy, median_ms, model_dir, prompt_ids, run_engine

FP8_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # SmolLM2-135M's linear layers


def fp8_rows(device: torch.device, model: str) -> list[Row]:
    """``--quantization fp8``: ``torch._scaled_mm`` (row-wise scales, bfloat16 out) against the
    dequantised CPU reference on SmolLM2's linear shapes at M = 64, timed against the bfloat16
    ``F.linear``; then the engine with fp8 weights (bfloat16, Triton attention), its greedy tokens
    against HF's bfloat16 (fp8 is not bit-exact: the row says how many first tokens agree)."""
    from engine.model.fp8_linear import check_cuda_fp8, fp8_linear, quantize_fp8

    try:
        check_cuda_fp8(device, FP8_SHAPES)
    except ValueError as err:
        return [Row("fp8 GEMM (torch._scaled_mm)", "-", note=f"skipped: {err}")]
    rows = []
    for out_features, in_features in FP8_SHAPES:
        weight = torch.randn(out_features, in_features, device=device) * 0.05
        qweight, scale = quantize_fp8(weight)
        x = torch.randn(64, in_features, device=device, dtype=torch.bfloat16)
        got = fp8_linear(x, qweight, scale, None).float().cpu()
        want = fp8_linear(x.cpu(), qweight.cpu(), scale.cpu(), None).float()
        err = float((got - want).abs().max() / want.abs().max())
        weight_bf16 = weight.to(torch.bfloat16)
        rows.append(Row("fp8 GEMM (torch._scaled_mm) vs bf16 F.linear", f"{out_features}x{in_features}, M=64",
                        triton_ms=median_ms(lambda: fp8_linear(x, qweight, scale, None), device, 50, 5),
                        torch_ms=median_ms(lambda: F.linear(x, weight_bf16), device, 50, 5), rel_err=err,
                        ok=err < 1e-2, note="rel_err: against the CPU reference (bf16 output rounding)"))
    rows.append(_fp8_engine_row(device, model))
    return rows


def _fp8_engine_row(device: torch.device, model: str) -> Row:
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    max_tokens = 24
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir, label = model_dir(model, False, Path(scratch))
        config = EngineConfig(model=str(hf_dir), attention_backend="triton", device=str(device), dtype="bfloat16",
                              quantization="fp8", block_size=16, num_kv_blocks=256, max_model_len=512,
                              max_num_batched_tokens=512, enforce_eager=True)
        engine = LLMEngine.from_config(config)
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(device).eval()
        prompts = prompt_ids(hf_dir, hf_model.config.vocab_size)
    try:
        run_engine(engine, prompts[:1], 2)
        start = time.perf_counter()
        got = run_engine(engine, prompts, max_tokens)
        elapsed_ms = (time.perf_counter() - start) * 1e3
    finally:
        engine.shutdown()
    want = [hf_greedy(hf_model, ids, max_tokens, device) for ids in prompts]
    first = sum(g[:1] == w[:1] for g, w in zip(got, want))
    full = sum(g == w for g, w in zip(got, want))
    return Row("end-to-end fp8 weights vs HF bf16", f"{label}: {len(prompts)} prompts x {max_tokens} tok",
               triton_ms=elapsed_ms, ok=2 * first >= len(prompts),
               note=f"first token equal {first}/{len(prompts)}, all {max_tokens} equal {full}/{len(prompts)}")
