"""Building a simulation from command-line choices: the workload and the cluster."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from bench.arrivals import ArrivalConfig
from bench.workloads import PROMPT_SET_KINDS, TRACE_KINDS, WorkloadConfig, load_workload
from core.cost_model import CostModel
from core.worker_load import WorkerLoad
from engine.config import EngineConfig
from router.placement.prediction import SLO
from sim.cluster import DEFAULT_POOL_BLOCKS, ClusterSpec, RouterSpec, WorkerSpec, fitted_worker, roofline_worker
from sim.hardware import GPUS, MODELS, Roofline, lookup
from sim.workload import SimRequest, from_bench, load_trace


@dataclass(frozen=True)
class WorkloadChoice:
    kind: str
    path: Path | None
    num_requests: int = 0
    time_scale: float = 1.0  # traces: arrival x time_scale
    rate_per_s: float = 0.0  # > 0: Poisson arrivals at this rate (prompt sets need one)
    max_tokens: int = 0  # prompt sets: required; traces: 0 keeps the trace's
    seed: int = 0


def load_requests(choice: WorkloadChoice, tokenize=None) -> list[SimRequest]:
    """The requests of a ``tandem bench`` workload. Traces stream lazily (any size); prompt sets
    are tokenized by ``tokenize(text) -> list[int]`` (the bundled model's chat template when
    None).

    Raises:
        ValueError: unknown kind, a prompt set without a rate, a bad scale.
    """
    if choice.kind in TRACE_KINDS and choice.rate_per_s <= 0 and not choice.max_tokens:
        return load_trace(choice.path, choice.kind, choice.time_scale, choice.num_requests)
    if choice.kind in PROMPT_SET_KINDS and choice.rate_per_s <= 0:
        raise ValueError("a prompt set has no timestamps: give --rate (Poisson arrivals)")
    requests = load_workload(WorkloadConfig(choice.kind, choice.path, choice.num_requests, choice.max_tokens))
    if choice.kind in PROMPT_SET_KINDS:
        tokenize = tokenize or _chat_tokenizer()
        requests = [type(r)(tokenize(r.prompt), r.max_tokens, r.arrival_s, None) for r in requests]
    mode = "poisson" if choice.rate_per_s > 0 else "trace"
    arrivals = ArrivalConfig(mode, time_scale=choice.time_scale, rate_per_s=choice.rate_per_s or 1.0, seed=choice.seed)
    return from_bench(requests, arrivals)


def _chat_tokenizer():
    from core.model_source import DEFAULT_MODEL, resolve_model
    from router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    return lambda text: tokenizer.encode_chat([{"role": "user", "content": text}])


@dataclass(frozen=True)
class ClusterChoice:
    num_prefill: int
    num_decode: int
    gpu: str = "H200"
    model: str = "llama-3.1-8b"
    tp: int = 1
    cost_model: Path | None = None  # a fitted CostModel's JSON (fields of core.cost_model.CostModel)
    block_size: int = 16
    num_kv_blocks: int = 0  # 0: what fits the GPU memory (roofline), else required with cost_model
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 0  # 0: the model's
    router: RouterSpec = RouterSpec()
    # The pool's DRAM, all nodes together; in blocks: this over a block's bytes (at the KV cache
    # dtype). 0: DEFAULT_POOL_BLOCKS blocks, whatever their size.
    pool_capacity_bytes: int = 0
    kv_cache_dtype: str = "auto"  # the workers' --kv-cache-dtype: auto (the model's dtype), fp8, int8


def read_cost_model(path: Path) -> CostModel:
    """A CostModel from JSON: its fields, or a heartbeat load (``cost_*`` keys, the wire format
    of core.worker_load.WorkerLoad).

    Raises:
        ValueError: neither, or nothing was measured.
    """
    data = json.loads(Path(path).read_text())
    if any(k.startswith("cost_") for k in data):
        model = WorkerLoad.from_wire(data).fitted_cost_model
        if model is None:
            raise ValueError(f"{path}: the load carries no fitted cost model")
        return model
    try:
        return CostModel(**data)
    except TypeError as err:
        raise ValueError(f"{path}: not a CostModel ({err})") from None


def build_worker(c: ClusterChoice, tp: int) -> WorkerSpec:
    """A worker of ``tp`` GPUs: timed by the fitted cost model of ``c.cost_model`` (its KV bytes
    per token are the measured worker's), else by the roofline of ``c.gpu`` and ``c.model`` with
    KV at ``c.kv_cache_dtype`` (its KV blocks: what fits the GPUs unless ``c.num_kv_blocks``).

    Raises:
        ValueError: a fitted cost model without --num-kv-blocks and --max-model-len, or with an
            8-bit --kv-cache-dtype (fit one on a worker run with it); an unknown GPU, model or KV
            cache dtype; a context beyond the model's; a model the GPUs cannot hold.
    """
    if c.cost_model is not None:
        cost = read_cost_model(c.cost_model)
        if not c.num_kv_blocks or not c.max_model_len:
            raise ValueError("a fitted cost model needs --num-kv-blocks and --max-model-len (the worker's)")
        if c.kv_cache_dtype != "auto":
            raise ValueError(f"--kv-cache-dtype {c.kv_cache_dtype} times roofline workers; a fitted cost model "
                             "carries its worker's own KV bytes per token (fit it on a worker run with "
                             f"--kv-cache-dtype {c.kv_cache_dtype})")
        engine = EngineConfig(block_size=c.block_size, num_kv_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
                              max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len)
        return fitted_worker(cost, engine, cost.kv_bytes_per_token)
    model = dataclasses.replace(lookup(MODELS, c.model, "model"), kv_cache_dtype=c.kv_cache_dtype)
    roofline = Roofline(lookup(GPUS, c.gpu, "GPU"), model, tp)
    if c.max_model_len > roofline.model.max_model_len:
        raise ValueError(f"--max-model-len {c.max_model_len} exceeds {c.model}'s max_position_embeddings "
                         f"({roofline.model.max_model_len})")
    engine = EngineConfig(block_size=c.block_size, num_kv_blocks=c.num_kv_blocks or roofline.num_kv_blocks(c.block_size),
                          max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                          max_model_len=c.max_model_len or roofline.model.max_model_len)
    return roofline_worker(roofline, engine)


def pool_capacity_blocks(c: ClusterChoice, worker: WorkerSpec) -> int:
    """Blocks the pool holds: ``c.pool_capacity_bytes`` // one block's bytes (``block_size`` x
    the worker's KV bytes per token: an 8-bit KV cache's rows with their scales);
    DEFAULT_POOL_BLOCKS when ``c.pool_capacity_bytes`` is 0.

    Raises:
        ValueError: a negative capacity, one below one block, or a worker whose KV bytes per
            token are unknown (a fitted cost model that measured none).
    """
    if c.pool_capacity_bytes < 0:
        raise ValueError(f"--pool-capacity-bytes must be >= 0, got {c.pool_capacity_bytes}")
    if c.pool_capacity_bytes == 0:
        return DEFAULT_POOL_BLOCKS
    block_bytes = c.block_size * worker.kv_bytes_per_token
    if block_bytes <= 0:
        raise ValueError("--pool-capacity-bytes needs the workers' KV bytes per token; the cost model has none")
    blocks = int(c.pool_capacity_bytes // block_bytes)
    if blocks < 1:
        raise ValueError(f"--pool-capacity-bytes {c.pool_capacity_bytes} holds no block of {block_bytes:.0f} bytes")
    return blocks


def build_cluster(c: ClusterChoice) -> ClusterSpec:
    """The cluster of ``c``: its worker counts of one :func:`build_worker` kind, its pool and router.

    Raises:
        ValueError: as :func:`build_worker` and :func:`pool_capacity_blocks`.
    """
    worker = build_worker(c, c.tp)
    return ClusterSpec(c.num_prefill, c.num_decode, worker, worker, pool_capacity_blocks(c, worker), c.router)


def kv_footprint(c: ClusterChoice, worker: WorkerSpec, mean_prompt_tokens: float) -> dict:
    """What the KV cache dtype changes, for the command's output and JSON: KV bytes per token and
    per block, blocks per worker and in the pool, and one KV hop of a mean prompt (bytes, seconds
    on the worker's NIC: prefill -> pool and pool -> decode each take one)."""
    block_bytes = c.block_size * worker.kv_bytes_per_token
    return {"kv_cache_dtype": c.kv_cache_dtype, "kv_bytes_per_token": worker.kv_bytes_per_token,
            "block_bytes": block_bytes, "num_kv_blocks": worker.engine.num_kv_blocks,
            "pool_capacity_bytes": c.pool_capacity_bytes, "pool_capacity_blocks": pool_capacity_blocks(c, worker),
            "mean_prompt_tokens": mean_prompt_tokens,
            "mean_prompt_kv_bytes": mean_prompt_tokens * worker.kv_bytes_per_token,
            "mean_prompt_transfer_s": worker.transfer_s(round(mean_prompt_tokens))}


def router_spec(policy: str, disaggregation: str, ttft_slo_s: float, tbt_slo_s: float, max_candidates: int) -> RouterSpec:
    return RouterSpec(policy, disaggregation, SLO(ttft_slo_s, tbt_slo_s), max_candidates=max_candidates)
