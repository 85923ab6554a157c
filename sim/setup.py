"""Building a simulation from command-line choices: the workload and the cluster."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bench.arrivals import ArrivalConfig
from bench.workloads import PROMPT_SET_KINDS, TRACE_KINDS, WorkloadConfig, load_workload
from core.cost_model import CostModel
from core.worker_load import WorkerLoad
from engine.config import EngineConfig
from router.placement.prediction import SLO
from sim.cluster import ClusterSpec, RouterSpec, WorkerSpec, fitted_worker, roofline_worker
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
    pool_capacity_blocks: int = 1 << 22


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
    if c.cost_model is not None:
        cost = read_cost_model(c.cost_model)
        if not c.num_kv_blocks or not c.max_model_len:
            raise ValueError("a fitted cost model needs --num-kv-blocks and --max-model-len (the worker's)")
        engine = EngineConfig(block_size=c.block_size, num_kv_blocks=c.num_kv_blocks, max_num_seqs=c.max_num_seqs,
                              max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=c.max_model_len)
        return fitted_worker(cost, engine, cost.kv_bytes_per_token)
    roofline = Roofline(lookup(GPUS, c.gpu, "GPU"), lookup(MODELS, c.model, "model"), tp)
    if c.max_model_len > roofline.model.max_model_len:
        raise ValueError(f"--max-model-len {c.max_model_len} exceeds {c.model}'s max_position_embeddings "
                         f"({roofline.model.max_model_len})")
    engine = EngineConfig(block_size=c.block_size, num_kv_blocks=c.num_kv_blocks or roofline.num_kv_blocks(c.block_size),
                          max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                          max_model_len=c.max_model_len or roofline.model.max_model_len)
    return roofline_worker(roofline, engine)


def build_cluster(c: ClusterChoice) -> ClusterSpec:
    worker = build_worker(c, c.tp)
    return ClusterSpec(c.num_prefill, c.num_decode, worker, worker, c.pool_capacity_blocks, c.router)


def router_spec(policy: str, disaggregation: str, ttft_slo_s: float, tbt_slo_s: float, max_candidates: int) -> RouterSpec:
    return RouterSpec(policy, disaggregation, SLO(ttft_slo_s, tbt_slo_s), max_candidates=max_candidates)
