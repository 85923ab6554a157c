"""Builds a rank's shard of the model, its KV cache and its runner (rank 0 and the others)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.model_source import ModelSource, resolve_model
from engine.attention_selector import make_attention_backend
from engine.config import EngineConfig
from engine.kv_cache.kv_quant import allocate_kv_cache, cache_dtype
from engine.model.compile import compile_layers
from engine.model.gguf_convert import ensure_hf_dir
from engine.model.linear_chooser import LinearSetup
from engine.model.loader import TORCH_DTYPES, load_model
from engine.model_runner import ModelRunner
from engine.parallel.group import RankFailure, RankGroup
from engine.parallel.launch import RankProcesses, start_ranks
from engine.parallel.layers import layout_of, shard_model
from engine.parallel.layout import ShardLayout
from engine.parallel.runner import TensorParallelRunner
from engine.sampler import Sampler


def _reraise(err: RankFailure) -> None:
    raise err


@dataclass
class TensorParallel:
    """Rank 0's handle on its worker's ranks. ``on_failure(err)`` runs when a collective fails
    (default: the error propagates; a served worker exits instead, see worker.runtime)."""

    group: RankGroup
    layout: ShardLayout
    processes: RankProcesses
    on_failure: Callable[[RankFailure], None] = field(default=_reraise)

    def runner(self, model, kv_cache, backend, sampler) -> TensorParallelRunner:
        return TensorParallelRunner(model, kv_cache, backend, sampler, self.group, self.layout,
                                    on_shutdown=lambda: self.processes.stop(self.group),
                                    on_failure=lambda err: self.on_failure(err))


def load_sharded(config: EngineConfig, source: ModelSource, group: RankGroup) -> tuple[torch.nn.Module, ShardLayout]:
    """This rank's shard of the model on its device (linear layers planned: engine.model.linear_chooser)."""
    layouts: list[ShardLayout] = []

    def shard(model) -> None:
        layouts.append(layout_of(model, group.rank, group.world_size))
        shard_model(model, layouts[0], group)

    model = load_model(ensure_hf_dir(source), config.dtype, group.device, config.max_model_len,
                       LinearSetup.from_config(config), shard=shard, quantization=config.quantization)
    return model, layouts[0]


def start_tensor_parallel(config: EngineConfig, source: ModelSource) -> tuple[torch.nn.Module, TensorParallel]:
    """Starts ranks 1..N-1, joins them as rank 0 and loads rank 0's shard.

    Raises:
        ValueError: the model cannot be sharded ``config.tensor_parallel_size`` ways (checked
            before any rank starts).
        RuntimeError: another tensor-parallel engine of this process is still up.
    """
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(ensure_hf_dir(source))
    ShardLayout(0, config.tensor_parallel_size, hf.num_attention_heads, hf.num_key_value_heads,
                hf.intermediate_size, hf.vocab_size)  # raises before any rank starts
    if torch.distributed.is_initialized():
        raise RuntimeError("one tensor-parallel engine per process (torch.distributed has one default group): "
                           "shut the other engine down first")
    group, processes = start_ranks(config, build_rank_runner)
    try:
        model, layout = load_sharded(config, source, group)
    except Exception:
        processes.stop(group)
        raise
    return model, TensorParallel(group, layout, processes)


def build_rank_runner(config: EngineConfig, group: RankGroup) -> ModelRunner:
    """A rank > 0's plain ModelRunner over its shard and its KV heads (its sampler is unused)."""
    model, layout = load_sharded(config, resolve_model(config.model), group)
    if config.compiled:
        compile_layers(model)
    mc = model.config
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    kv_cache = allocate_kv_cache(mc.num_hidden_layers, config.num_kv_blocks, config.block_size,
                                 len(layout.kv_heads()), head_dim,
                                 cache_dtype(config.kv_cache_dtype, TORCH_DTYPES[config.dtype]), group.device)
    return ModelRunner(model, kv_cache, make_attention_backend(config), Sampler(config.seed))
