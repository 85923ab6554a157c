"""One GPU check for the Triton kernels, under ten minutes on one H200.

1. the kernel tests (``tests/unit/engine/kernels``) on the GPU;
2. each kernel timed (median of many, CUDA events) against its torch reference and against the
   bandwidth floor: bytes moved / the device's measured device-to-device copy bandwidth (a copy
   of N bytes counts 2N: read + write), including decode attention at batch 64 x 4k context;
3. a decode-kernel sweep (tile size, context splits) at that shape;
4. the end-to-end greedy check: the engine with the Triton backend against transformers'
   ``generate()``, float32 — on SmolLM2-135M-Instruct when it can be loaded, else on random
   weights of its shape (labelled as such in the table);
5. the same at tensor-parallel size 2 (NCCL, eager and compiled) when two GPUs are visible; with
   one GPU the table says it was skipped.
6. ``--quantization fp8`` (``benchmarks/gpu_check_fp8.py``): ``torch._scaled_mm`` on the model's linear shapes against the CPU
   reference, timed against bfloat16, and the engine with fp8 weights against HF's bfloat16
   greedy tokens (first-token agreement); skipped, saying why, below compute capability 8.9.

Prints one table; exits 1 when a check fails, 2 when there is no GPU. ``--cpu-smoke`` runs a tiny
version on CPU under Triton's interpreter so the script itself stays exercised in CI.

Usage: ``benchmarks/gpu_check.sh [--cpu-smoke] [--model NAME_OR_PATH] [--out FILE]``
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
NO_GPU_MESSAGE = (
    "gpu_check: no CUDA GPU is present on this machine; nothing was measured "
    "(--cpu-smoke runs a tiny version under the Triton interpreter)"
)


@dataclass
class Row:
    """One line of the table. Times in milliseconds; ``floor_ms`` = bytes moved / copy bandwidth."""

    name: str
    shape: str
    triton_ms: float | None = None
    torch_ms: float | None = None
    floor_ms: float | None = None
    rel_err: float | None = None
    ok: bool = True
    note: str = ""


@dataclass
class Case:
    """A kernel and its torch reference on the same inputs; both return the tensor to compare."""

    name: str
    shape: str
    run_triton: Callable[[], torch.Tensor]
    run_torch: Callable[[], torch.Tensor]
    bytes_moved: int
    tol: float  # on max |triton - torch| / max |torch|
    flops: int = 0


def median_ms(fn: Callable[[], object], device: torch.device, iters: int, warmup: int) -> float:
    """Median wall time of ``fn``: CUDA events around each call on a GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth_bytes_per_s(device: torch.device, size_bytes: int, iters: int) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    src = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, iters, warmup=min(3, iters))
    return 2 * size_bytes / (ms / 1e3)


def paged_inputs(num_seqs, ctx_len, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """A random cache with each sequence's blocks shuffled over it; block tables [S, ctx/bs]."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = -(-ctx_len // block_size)
    num_blocks = num_seqs * blocks_per_seq
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).view(num_seqs, blocks_per_seq)
    return cache, tables


def decode_case(num_seqs, ctx_len, num_heads, num_kv_heads, head_dim, dtype, device, **kernel_args) -> Case:
    from engine.attention import AttentionMetadata, TorchAttentionBackend
    from engine.kernels.paged_decode_attention import paged_decode_attention

    cache, tables = paged_inputs(num_seqs, ctx_len, num_kv_heads, head_dim, 16, dtype, device)
    query = torch.randn(num_seqs, num_heads, head_dim, device=device).to(dtype)
    seq_lens = torch.full((num_seqs,), ctx_len, dtype=torch.long)
    seq_lens_dev = seq_lens.to(device)
    no_slots = torch.empty(0, dtype=torch.long, device=device)  # the reference's decode path reads no slots
    meta = AttentionMetadata(no_slots, torch.arange(num_seqs + 1), seq_lens, tables, 1, ctx_len)
    scale = head_dim**-0.5
    elem = cache.element_size()
    args = "".join(f", {k}={v}" for k, v in kernel_args.items())
    return Case(
        name=f"decode attention{args}",
        shape=f"{num_seqs}x{ctx_len} ctx, H {num_heads}/{num_kv_heads}, D {head_dim}, {str(dtype)[6:]}",
        run_triton=lambda: paged_decode_attention(query, cache, tables, seq_lens_dev, ctx_len, scale, **kernel_args),
        run_torch=lambda: TorchAttentionBackend._decode(query, cache, meta, scale),
        bytes_moved=num_seqs * ctx_len * num_kv_heads * head_dim * 2 * elem + 2 * query.numel() * elem,
        tol=1e-4 if dtype == torch.float32 else 2e-2,
        flops=4 * num_seqs * ctx_len * num_heads * head_dim,
    )


def prefill_case(num_seqs, q_len, ctx_len, num_heads, num_kv_heads, head_dim, dtype, device) -> Case:
    """``q_len`` new tokens per sequence after ``ctx_len - q_len`` cached ones (chunked prefill)."""
    from engine.attention import AttentionMetadata, TorchAttentionBackend
    from engine.kernels.paged_prefill_attention import paged_prefill_attention

    cache, tables = paged_inputs(num_seqs, ctx_len, num_kv_heads, head_dim, 16, dtype, device)
    query = torch.randn(num_seqs * q_len, num_heads, head_dim, device=device).to(dtype)
    starts = torch.arange(num_seqs + 1) * q_len
    seq_lens = torch.full((num_seqs,), ctx_len, dtype=torch.long)
    starts_dev, seq_lens_dev = starts.to(device), seq_lens.to(device)
    slots = torch.empty(0, dtype=torch.long, device=device)  # K/V already in the cache
    meta = AttentionMetadata(slots, starts, seq_lens, tables, q_len, ctx_len)
    scale = head_dim**-0.5
    elem = cache.element_size()
    empty_kv = torch.empty(0, num_kv_heads, head_dim, dtype=dtype, device=device)  # reference writes nothing
    cached = ctx_len - q_len
    return Case(
        name="prefill attention" if cached == 0 else "chunked prefill attention",
        shape=f"{num_seqs}x{q_len} new + {cached} cached, H {num_heads}/{num_kv_heads}, D {head_dim}, {str(dtype)[6:]}",
        run_triton=lambda: paged_prefill_attention(query, cache, tables, starts_dev, seq_lens_dev, q_len, scale),
        run_torch=lambda: TorchAttentionBackend().forward(query, empty_kv, empty_kv, cache, meta, scale),
        bytes_moved=num_seqs * ctx_len * num_kv_heads * head_dim * 2 * elem + 2 * query.numel() * elem,
        tol=1e-4 if dtype == torch.float32 else 2e-2,
        flops=4 * num_seqs * q_len * (cached + (q_len + 1) / 2) * num_heads * head_dim,
    )


def kv_write_case(num_tokens, num_kv_heads, head_dim, dtype, device) -> Case:
    from engine.attention import write_kv
    from engine.kernels.kv_cache_write import kv_cache_write

    num_blocks = 2 * -(-num_tokens // 16)
    cache = torch.zeros(2, num_blocks, 16, num_kv_heads, head_dim, dtype=dtype, device=device)
    ref = cache.clone()
    key = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * 16, device=device)[:num_tokens]
    elem = key.element_size()

    def run_triton():
        kv_cache_write(key, value, cache, slots)
        return cache

    def run_torch():
        write_kv(key, value, ref, slots)
        return ref

    return Case("kv-cache write", f"{num_tokens} tok, H_kv {num_kv_heads}, D {head_dim}, {str(dtype)[6:]}",
                run_triton, run_torch, 4 * key.numel() * elem + slots.numel() * 8, tol=0.0)


def block_copy_cases(num_layers, num_blocks, n, num_kv_heads, head_dim, dtype, device) -> list[Case]:
    from engine.kernels.block_copy import gather_blocks, scatter_blocks

    cache = torch.randn(num_layers, 2, num_blocks, 16, num_kv_heads, head_dim, device=device).to(dtype)
    ids = torch.randperm(num_blocks, device=device)[:n]
    staging = gather_blocks(cache, ids).clone()
    ref_cache = cache.clone()
    moved = 2 * staging.numel() * staging.element_size()
    shape = f"{n} of {num_blocks} blocks, {num_layers} layers, H_kv {num_kv_heads}, D {head_dim}, {str(dtype)[6:]}"

    def scatter_triton():
        scatter_blocks(cache, ids, staging)
        return cache

    def scatter_torch():
        ref_cache.index_copy_(2, ids, staging.permute(1, 2, 0, 3, 4, 5))
        return ref_cache

    return [
        Case("block pack (gather)", shape, lambda: gather_blocks(cache, ids),
             lambda: cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous(), moved, tol=0.0),
        Case("block unpack (scatter)", shape, scatter_triton, scatter_torch, moved, tol=0.0),
    ]


def kernel_cases(device: torch.device, smoke: bool) -> list[Callable[[], list[Case]]]:
    """Builders (inputs made one case at a time): serving shapes on a GPU — bf16 with Llama-8B-like
    heads, and SmolLM2's fp32 heads — or tiny ones in smoke mode."""
    if smoke:
        f32 = torch.float32
        return [
            lambda: [kv_write_case(20, 2, 64, f32, device)],
            lambda: block_copy_cases(2, 6, 3, 2, 64, f32, device),
            lambda: [decode_case(3, 40, 6, 2, 64, f32, device)],
            lambda: [prefill_case(2, 8, 24, 6, 2, 64, f32, device)],
        ]
    bf16, f32 = torch.bfloat16, torch.float32
    return [
        lambda: [kv_write_case(16384, 8, 128, bf16, device)],
        lambda: block_copy_cases(32, 1024, 256, 8, 128, bf16, device),
        lambda: [decode_case(64, 4096, 32, 8, 128, bf16, device)],
        lambda: [decode_case(64, 4096, 9, 3, 64, f32, device)],
        lambda: [prefill_case(8, 1024, 1024, 32, 8, 128, bf16, device)],
        lambda: [prefill_case(16, 256, 2048, 32, 8, 128, bf16, device)],
    ]


def time_case(case: Case, device: torch.device, copy_bw: float, smoke: bool) -> Row:
    got, want = case.run_triton(), case.run_torch()
    rel_err = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()
    iters, warmup = (1, 0) if smoke else (50, 5)
    row = Row(case.name, case.shape, rel_err=rel_err, ok=rel_err <= case.tol)
    row.triton_ms = median_ms(case.run_triton, device, iters, warmup)
    row.torch_ms = median_ms(case.run_torch, device, iters, warmup)
    row.floor_ms = case.bytes_moved / copy_bw * 1e3
    if case.flops:
        row.note = f"{case.flops / (row.triton_ms / 1e3) / 1e12:.1f} TFLOP/s"
    return row


def decode_sweep(device: torch.device, copy_bw: float) -> list[Row]:
    """Decode at batch 64 x 4k over tile sizes and context splits, to pick the defaults."""
    rows = []
    for block_n in (32, 64, 128):
        for num_splits in (1, 2, 4):
            case = decode_case(64, 4096, 32, 8, 128, torch.bfloat16, device, block_n=block_n, num_splits=num_splits)
            row = Row(case.name, case.shape, floor_ms=case.bytes_moved / copy_bw * 1e3)
            row.triton_ms = median_ms(case.run_triton, device, iters=30, warmup=3)
            rows.append(report(row))
    return rows


def kernel_tests_row(device: torch.device) -> Row:
    """pytest on the kernel tests; ``--confcutdir`` keeps the repo-wide conftest (redis) out."""
    start = time.perf_counter()
    kernels = REPO / "tests" / "unit" / "engine" / "kernels"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--confcutdir={kernels}", str(kernels)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    summary = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    if proc.returncode != 0:
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
    return Row("kernel tests", f"pytest on {device.type}", triton_ms=(time.perf_counter() - start) * 1e3,
               ok=proc.returncode == 0, note=summary)


def random_llama_dir(target: Path, tiny: bool) -> Path:
    """Random weights in SmolLM2-135M's shape (or a 2-layer toy), saved as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(vocab_size=512, hidden_size=384, intermediate_size=512, num_hidden_layers=2,
                 num_attention_heads=6, num_key_value_heads=2, head_dim=64)
    if not tiny:
        shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    config = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(target)
    return target


def model_dir(model: str, smoke: bool, scratch: Path) -> tuple[Path, str]:
    """The real checkpoint's HF folder when it resolves here, else a random-weight stand-in."""
    if not smoke:
        try:
            from core.model_source import resolve_model
            from engine.model.gguf_convert import ensure_hf_dir

            return ensure_hf_dir(resolve_model(model)), model
        except Exception as exc:  # noqa: BLE001 - any failure means "not available on this machine"
            print(f"gpu_check: {model} is not available here ({type(exc).__name__}: {exc}); using random weights")
    label = "random weights (toy)" if smoke else "random weights, SmolLM2 shape"
    return random_llama_dir(scratch / "random-llama", tiny=smoke), label


def prompt_ids(hf_dir: Path, vocab_size: int) -> list[list[int]]:
    texts = ["The capital of France is", "def fibonacci(n):", "Water boils at", "Once upon a time, in a small village,"]
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        return [list(tok(t)["input_ids"]) for t in texts]
    except Exception:  # noqa: BLE001 - random-weight folders have no tokenizer
        return [[(37 * i + 11 * j) % (vocab_size - 3) + 3 for j in range(5 + 3 * i)] for i in range(len(texts))]


def run_engine(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from core.request import Request
    from core.sampling_params import SamplingParams

    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts):
        engine.add_request(Request(str(i), ids, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


def hf_greedy(hf_model, ids: list[int], max_tokens: int, device: torch.device) -> list[int]:
    with torch.inference_mode():
        x = torch.tensor([ids], device=device)
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
                                pad_token_id=hf_model.config.eos_token_id)
    return out[0, len(ids):].tolist()


def e2e_row(device: torch.device, smoke: bool, model: str, compiled: bool = False, tp: int = 1) -> Row:
    """Batched engine run with the Triton backend (eager, or the torch.compile'd forward) vs
    transformers ``generate()`` one prompt at a time; ``tp`` > 1: tensor-parallel over that many
    GPUs (NCCL; rank 0 on this process's GPU, the others spawned on the next ones)."""
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.engine import LLMEngine

    max_tokens = 3 if smoke else 24
    with tempfile.TemporaryDirectory() as scratch:
        hf_dir, label = model_dir(model, smoke, Path(scratch))
        config = EngineConfig(model=str(hf_dir), attention_backend="triton", device=str(device), dtype="float32",
                              block_size=16, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=512,
                              enforce_eager=not compiled, tensor_parallel_size=tp)
        build_start = time.perf_counter()
        engine = LLMEngine.from_config(config)
        build_s = time.perf_counter() - build_start
        hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device).eval()
        prompts = prompt_ids(hf_dir, hf_model.config.vocab_size)[: 1 if smoke else None]
    try:
        run_engine(engine, prompts[:1], 2)  # warm: first-call allocations and autotuning out of the timing
        start = time.perf_counter()
        got = run_engine(engine, prompts, max_tokens)
        elapsed_ms = (time.perf_counter() - start) * 1e3
    finally:
        engine.shutdown()  # tensor-parallel ranks exit (nothing at TP=1)
    want = [hf_greedy(hf_model, ids, max_tokens, device) for ids in prompts]
    equal = sum(g == w for g, w in zip(got, want))
    mode = ("compiled" if compiled else "eager") + (f", TP={tp}" if tp > 1 else "")
    for g, w in zip(got, want):
        if g != w:
            print(f"gpu_check: greedy mismatch ({mode}): triton {g} vs hf {w}")
    return Row(f"end-to-end greedy vs HF, {mode}", f"{label}: {len(prompts)} prompts x {max_tokens} tok, fp32",
               triton_ms=elapsed_ms, ok=equal == len(prompts),
               note=f"{equal}/{len(prompts)} equal (ms: whole batch; engine built in {build_s:.1f} s)")


def tensor_parallel_rows(device: torch.device, model: str) -> list[Row]:
    """TP=2 greedy vs HF (eager and compiled) when the device has two GPUs; else one row saying so."""
    if torch.cuda.device_count() < 2:
        return [Row("end-to-end greedy vs HF, TP=2", "-", note=f"skipped: {torch.cuda.device_count()} GPU visible, "
                                                             "TP=2 needs 2")]
    return [e2e_row(device, False, model, compiled=compiled, tp=2) for compiled in (False, True)]


def report(row: Row) -> Row:
    """Prints a row the moment it is measured (a run stopped by a time limit still shows it)."""
    print(f"gpu_check: {row.name} [{row.shape}]: triton {_fmt(row.triton_ms)} ms, torch {_fmt(row.torch_ms)} ms, "
          f"floor {_fmt(row.floor_ms)} ms, {'ok' if row.ok else 'FAIL'} {row.note}", flush=True)
    return row


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def format_table(rows: list[Row]) -> str:
    head = ("check", "shape", "triton ms", "torch ms", "speedup", "floor ms", "% of floor", "rel err", "ok", "note")
    lines = [head]
    for r in rows:
        speedup = r.torch_ms / r.triton_ms if r.torch_ms and r.triton_ms else None
        pct = 100 * r.floor_ms / r.triton_ms if r.floor_ms and r.triton_ms else None
        err = "-" if r.rel_err is None else f"{r.rel_err:.1e}"
        lines.append((r.name, r.shape, _fmt(r.triton_ms), _fmt(r.torch_ms), _fmt(speedup, 2), _fmt(r.floor_ms),
                      _fmt(pct, 1), err, "ok" if r.ok else "FAIL", r.note))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines]
    text.insert(1, "-" * len(text[0]))
    return "\n".join(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny run on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name or path for the greedy check")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the kernel tests")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the first kernel module import (all lazy here)
    elif not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return 2
    smoke = args.cpu_smoke
    device = torch.device("cpu" if smoke else "cuda")
    rows = [] if smoke or args.skip_tests else [report(kernel_tests_row(device))]
    copy_bw = copy_bandwidth_bytes_per_s(device, 1 << (26 if smoke else 30), iters=3 if smoke else 20)
    for build in kernel_cases(device, smoke):
        rows += [report(time_case(case, device, copy_bw, smoke)) for case in build()]
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    sweep = [] if smoke else decode_sweep(device, copy_bw)
    rows.append(report(e2e_row(device, smoke, args.model)))
    if not smoke:  # the compiled forward (torch.compile per layer, inductor + Triton) on CUDA
        rows.append(report(e2e_row(device, smoke, args.model, compiled=True)))
        rows += [report(row) for row in tensor_parallel_rows(device, args.model)]
        sys.modules.setdefault("gpu_check", sys.modules[__name__])  # gpu_check_fp8 imports this module's helpers
        from gpu_check_fp8 import fp8_rows

        rows += [report(row) for row in fp8_rows(device, args.model)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter, smoke)"
    text = f"{name}: copy bandwidth {copy_bw / 1e9:.1f} GB/s (read + write)\n{format_table(rows)}"
    if sweep:
        text += "\n\ndecode sweep (batch 64 x 4k, bf16)\n" + format_table(sweep)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
