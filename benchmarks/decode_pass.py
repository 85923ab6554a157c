"""The in-process decode pass against the memory-bandwidth floor (bench/roofline.py), per path.

    .venv/bin/python benchmarks/decode_pass.py [--batch 1 --batch 16] [--context 150] [--threads 2]
        [--quantizations none,int8]

For each path (``eager/cpu``: eager forward, CPU attention backend; ``compiled/cpu``; ``eager/torch``) it builds one engine on the real
model, admits ``batch`` requests of ``context`` random prompt tokens, lets them prefill, then
times decode passes (the ModelRunner's forward + sampling time, no RPC). The floor is what one
pass must read at the machine's measured copy bandwidth: every weight once plus every sequence's
K/V (``roofline.decode_bound_s``); with ``--quantizations int8`` each path also runs with int8
weights, whose floor counts the bytes of the int8 linear weights and their scales as loaded. Prints
one table and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import roofline  # noqa: E402
from core.model_source import DEFAULT_MODEL, resolve_model  # noqa: E402
from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from engine.model.linear import Linear  # noqa: E402
from engine.model.gguf_convert import ensure_hf_dir  # noqa: E402

PATHS = {  # name: EngineConfig overrides
    "eager/cpu": dict(enforce_eager=True, attention_backend="cpu"),
    "compiled/cpu": dict(enforce_eager=False, attention_backend="cpu"),
    "eager/torch": dict(enforce_eager=True, attention_backend="torch"),  # the readable reference
}


def decode_pass_ms(engine: LLMEngine, batch: int, context: int, passes: int, seed: int) -> float:
    """Median forward + sampling time of ``passes`` decode passes at ``batch`` sequences whose
    context starts at ``context`` tokens."""
    rng = random.Random(seed)
    vocab = engine.runner.model.config.vocab_size
    requests = [Request(f"d{seed}-{i}", [rng.randrange(100, vocab) for _ in range(context)],
                        SamplingParams(temperature=0, max_tokens=passes + 3, ignore_eos=True)) for i in range(batch)]
    for request in requests:
        engine.add_request(request)
    times_s = []
    busy = engine.runner.busy_time_s
    for outputs in engine.step_stream():
        now = engine.runner.busy_time_s
        if all(r.num_output_tokens >= 2 for r in requests):  # prefill and the first decode done
            times_s.append(now - busy)
        busy = now
    return statistics.median(times_s[:passes]) * 1e3


def linear_weight_bytes(engine: LLMEngine) -> int:
    """Bytes one pass reads for the linear layers' weights (int8 weights with their scales)."""
    total = 0
    for layer in engine.runner.model.modules():
        if isinstance(layer, Linear):
            for t in (layer.gemm_weight, layer.weight_scale, layer.bias):
                total += 0 if t is None else t.numel() * t.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch", type=int, action="append", help="batch sizes (default 1 and 16)")
    parser.add_argument("--context", type=int, default=150, help="prompt tokens per sequence")
    parser.add_argument("--passes", type=int, default=24)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--paths", default=",".join(PATHS), help="comma-separated subset of: " + ", ".join(PATHS))
    parser.add_argument("--linear-backends", default="auto",
                        help="comma-separated GEMM backends, each path run with each (auto, onednn, mkl, torch)")
    parser.add_argument("--quantizations", default="none",
                        help="comma-separated weight quantizations, each variant run with each (none, int8, w8a16)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="weights and KV (the floor counts float32 bytes: halve it for bfloat16)")
    parser.add_argument("--out", type=Path, default=Path("bench-results/decode_pass.json"))
    args = parser.parse_args(argv)
    batches = args.batch or [1, 16]
    hf_dir = ensure_hf_dir(resolve_model(args.model))
    footprint = roofline.ModelFootprint.from_hf_dir(hf_dir)
    bandwidth = roofline.copy_bandwidth_bytes_per_s()
    rows = []
    variants = [(path, linear, quant) for path in args.paths.split(",") for linear in args.linear_backends.split(",")
                for quant in args.quantizations.split(",")]
    for path, linear, quant in variants:
        name = f"{path} {linear}" + ("" if args.dtype == "float32" else f" {args.dtype}") + \
            ("" if quant == "none" else f" {quant}")
        config = EngineConfig(model=args.model, num_kv_blocks=1024, max_model_len=2048, num_threads=args.threads,
                              linear_backend=linear, dtype=args.dtype, quantization=quant, **PATHS[path])
        engine = LLMEngine.from_config(config)
        weights = footprint if quant == "none" else \
            dataclasses.replace(footprint, weight_bytes=linear_weight_bytes(engine))
        for batch in batches:
            decode_pass_ms(engine, batch, args.context, 3, seed=0)  # warm
            ms = decode_pass_ms(engine, batch, args.context, args.passes, seed=1)
            mean_context = args.context + 1 + args.passes / 2
            floor_ms = roofline.decode_bound_s(weights, batch, mean_context, bandwidth) * 1e3
            if args.dtype == "bfloat16":
                floor_ms /= 2  # every weight and KV byte is half as many
            rows.append(dict(path=name, batch=batch, context=mean_context, pass_ms=ms, floor_ms=floor_ms,
                             floor_over_pass=floor_ms / ms, pass_over_floor=ms / floor_ms))
        del engine
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s; weights {footprint.weight_bytes / 1e6:.0f} MB, "
          f"KV {footprint.kv_bytes_per_token} B/token")
    print(f"{'path':34} {'batch':>5} {'pass ms':>8} {'tok/s':>7} {'floor ms':>8} {'floor/pass':>10} {'pass/floor':>10}")
    for r in rows:
        print(f"{r['path']:34} {r['batch']:5d} {r['pass_ms']:8.1f} {1e3 * r['batch'] / r['pass_ms']:7.1f} "
              f"{r['floor_ms']:8.1f} {r['floor_over_pass']:10.2f} {r['pass_over_floor']:10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(bandwidth_bytes_per_s=bandwidth, rows=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
