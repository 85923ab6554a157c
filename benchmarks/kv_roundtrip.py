"""Round-trip error of 8-bit KV on the real model's K and V, by scale granularity.

    .venv/bin/python benchmarks/kv_roundtrip.py [--model SmolLM2-135M-Instruct] [--threads 2]

Prefills the eight built-in prompts (bench/prompts.py) through the float32 engine, takes the K
and V it wrote for every full block (all layers, all KV heads), and quantises them to fp8 (e4m3)
and int8 two ways: one scale per (token, head) row, as ``--kv-cache-dtype`` stores them
(engine.kv_cache.kv_quant), and one scale per (block, head) over the block's tokens, the
alternative. Prints, per format, granularity and K / V: the relative RMS error
``||x' - x|| / ||x||`` and the largest absolute error over the largest |x|, plus the bytes per
block of each layout. Deterministic: no sampling, no timing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prompts import BUILTIN_PROMPTS  # noqa: E402
from core.kv_cache_spec import KVCacheSpec  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.kv_cache.kv_quant import QMAX, STORAGE_DTYPES, dequantize_rows, quantize_rows  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402


def real_kv(model: str, threads: int) -> torch.Tensor:
    """K/V of every full prompt block: ``[num_blocks, num_layers, 2, block_size, H_kv, D]`` float32."""
    from transformers import AutoTokenizer

    config = EngineConfig(model=model, num_kv_blocks=256, max_model_len=1024, num_threads=threads)
    engine = LLMEngine.from_config(config, save_kv_on_finish=True)
    tokenizer = AutoTokenizer.from_pretrained(ensure_hf_dir(resolve_model(model)))
    spec = engine.spec
    blocks = []
    try:
        for i, prompt in enumerate(BUILTIN_PROMPTS):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            engine.add_request(Request(f"p{i}", ids, SamplingParams(max_tokens=1, temperature=0)))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.saved_kv:
                        blocks += out.saved_kv[: len(ids) // spec.block_size]  # full blocks only
    finally:
        engine.shutdown()
    shape = (spec.num_layers, 2, spec.block_size, spec.num_kv_heads, spec.head_dim)
    return torch.stack([torch.from_numpy(np.frombuffer(b, dtype=np.float32).copy()).view(shape) for b in blocks])


def per_block_round_trip(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One scale per (block, layer, K/V, head) over the block's tokens: ``x`` as the per-row
    quantiser would store it if every row of a block-head shared the largest |x| of the group."""
    qmax = QMAX[dtype]
    amax = x.abs().amax(dim=(3, 5), keepdim=True)  # over tokens and head_dim
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    y = (x / scale).clamp(-qmax, qmax)
    q = y.round() if dtype == torch.int8 else y.to(dtype).to(torch.float32)
    return q * scale


def errors(x: torch.Tensor, back: torch.Tensor) -> tuple[float, float]:
    return float((back - x).norm() / x.norm()), float((back - x).abs().max() / x.abs().max())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    kv = real_kv(args.model, args.threads)  # [n, L, 2, bs, H, D]
    n, num_layers, _, block_size, num_kv_heads, head_dim = kv.shape
    print(f"{n} full blocks of {block_size} tokens, {num_layers} layers, {num_kv_heads} KV heads, head_dim {head_dim}")
    print("| format | scale per | K rel. RMS | K max / max|K| | V rel. RMS | V max / max|V| |")
    print("|---|---|---:|---:|---:|---:|")
    for name, dtype in STORAGE_DTYPES.items():
        row = dequantize_rows(quantize_rows(kv, dtype))
        block = per_block_round_trip(kv, dtype)
        for label, back in (("token, head", row), ("block, head", block)):
            (k_rms, k_max), (v_rms, v_max) = errors(kv[:, :, 0], back[:, :, 0]), errors(kv[:, :, 1], back[:, :, 1])
            print(f"| {name} | {label} | {k_rms:.4f} | {k_max:.4f} | {v_rms:.4f} | {v_max:.4f} |")
    print("\n| KV dtype | bytes per block |")
    print("|---|---:|")
    for dtype, kv_dtype in (("float32", "auto"), ("bfloat16", "auto"), ("float32", "fp8"), ("float32", "int8")):
        spec = KVCacheSpec("m", "r", dtype, num_layers, num_kv_heads, head_dim, block_size, kv_cache_dtype=kv_dtype)
        print(f"| {spec.kv_dtype_name} | {spec.block_bytes:,} |")


if __name__ == "__main__":
    main()
