"""The physical limit of a decode step on this machine: memory bandwidth.

A decode step reads every weight once and the KV cache of every sequence in the batch once, so

    step_time >= (weight_bytes + batch x context_tokens x kv_bytes_per_token) / bandwidth

The bandwidth is measured STREAM-copy style (a = b on a buffer much larger than the caches; bytes
moved = read + write), the median of several repeats.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.kv_cache_spec import kv_bytes_per_token


@dataclass(frozen=True)
class ModelFootprint:
    weight_bytes: int
    kv_bytes_per_token: int  # K and V of every layer for one token

    @classmethod
    def from_hf_dir(cls, path: Path, kv_dtype_bytes: int = 4, kv_cache_dtype: str = "auto") -> ModelFootprint:
        """From a Hugging Face folder: weights = the safetensors files' size; KV from config.json
        (core.kv_cache_spec.kv_bytes_per_token: 2 x layers x kv_heads x a row of head_dim values
        of ``kv_dtype_bytes``, or of one byte plus its scale with an 8-bit ``kv_cache_dtype``)."""
        path = Path(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {path}")
        config = json.loads((path / "config.json").read_text())
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kv_heads = config.get("num_key_value_heads", heads)
        kv = kv_bytes_per_token(config["num_hidden_layers"], kv_heads, head_dim, kv_dtype_bytes, kv_cache_dtype)
        return cls(sum(f.stat().st_size for f in files), kv)

    def step_bytes(self, batch: float, context_tokens: float) -> float:
        return self.weight_bytes + batch * context_tokens * self.kv_bytes_per_token


def copy_bandwidth_bytes_per_s(buffer_bytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Median STREAM-copy bandwidth (read + write bytes per second) over ``repeats`` copies."""
    src = np.ones(buffer_bytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # first touch: page faults do not count
    times_s = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        times_s.append(time.perf_counter() - start)
    return 2 * src.nbytes / statistics.median(times_s)


def decode_bound_s(footprint: ModelFootprint, batch: float, context_tokens: float, bandwidth_bytes_per_s: float) -> float:
    """Lower bound of one decode step's time at this batch and mean context."""
    return footprint.step_bytes(batch, context_tokens) / bandwidth_bytes_per_s


def report(footprint: ModelFootprint, bandwidth_bytes_per_s: float, batch: float, context_tokens: float,
           measured_step_s: float) -> dict:
    """JSON-ready roofline entry: bound, measured step (mean TBT) and their ratio."""
    bound_s = decode_bound_s(footprint, batch, context_tokens, bandwidth_bytes_per_s)
    return {
        "bandwidth_gb_per_s": bandwidth_bytes_per_s / 1e9,
        "weight_bytes": footprint.weight_bytes,
        "kv_bytes_per_token": footprint.kv_bytes_per_token,
        "batch": batch,
        "context_tokens": context_tokens,
        "bound_ms": bound_s * 1000,
        "measured_step_ms": measured_step_s * 1000,
        # >= 1: how many times the memory-bandwidth bound one step takes; 1/x is the efficiency.
        "step_over_bound": measured_step_s / bound_s if bound_s else float("nan"),
    }
