"""Shards a loaded Llama in place for one tensor-parallel rank (Megatron-LM, Shoeybi et al. 2019).

Per decoder layer, two all-reduces of ``[num_tokens, hidden_size]``::

    x ─► qkv_proj (column-parallel: this rank's Q/K/V heads) ─► attention over its heads
      ─► o_proj (row-parallel: its heads' input columns) ─► all-reduce ─► + residual
      ─► gate_up_proj (column-parallel: its MLP columns) ─► SiLU·up
      ─► down_proj (row-parallel) ─► all-reduce ─► + residual

The embedding is **replicated**: a lookup costs no compute, so sharding it would only add a third
all-reduce per step to save memory (vocab x hidden per rank; 113 MB for SmolLM2 in float32). The
LM head is **vocabulary-parallel**: it is a GEMM of vocab x hidden, as large as three decoder
layers of SmolLM2, so each rank computes the logits of its own rows and one all-gather of
``[num_sampled, vocab / tp]`` puts them together (on every rank: rank 0 samples). A tied head is
a view of the replicated embedding's rows.

Row-parallel biases are added on rank 0 only, so the all-reduce adds them once.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.linear import Linear
from engine.model.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from engine.parallel.group import RankGroup
from engine.parallel.layout import ShardLayout


class RowParallelLinear(Linear):
    """A Linear over this rank's input columns; the partial products are summed over the ranks.

    ``forward(x [num_tokens, in_local]) -> [num_tokens, out]`` (the full output, on every rank).
    """

    group: RankGroup

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelHead(Linear):
    """The LM head's rows ``vocab_rows`` of this rank; ``forward(hidden [n, hidden_size])`` returns
    every rank's logits joined, ``[n, vocab_size]``, on every rank."""

    group: RankGroup
    row_counts: list[int]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = super().forward(x)  # [n, rows of this rank]
        width = max(self.row_counts)
        if local.shape[1] < width:  # all_gather wants equal shapes: pad the shorter runs
            local = nn.functional.pad(local, (0, width - local.shape[1]))
        parts = self.group.all_gather(local.contiguous())
        return torch.cat([part[:, :count] for part, count in zip(parts, self.row_counts)], dim=1)


def layout_of(model: LlamaForCausalLM, rank: int, tp: int) -> ShardLayout:
    """The :class:`ShardLayout` of ``model``'s config for ``rank`` of ``tp``."""
    c = model.config
    return ShardLayout(rank, tp, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size)


def shard_model(model: LlamaForCausalLM, layout: ShardLayout, group: RankGroup) -> None:
    """Replaces ``model``'s projections and LM head by this rank's shards (weights sliced, views
    where possible). Mutates ``model``; call it before moving the model to its device and
    prepacking (engine.model.loader.load_model's ``shard`` hook)."""
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, layout, group)
        _shard_mlp(layer.mlp, layout, group)
    rows = layout.vocab_rows()
    head = _linear(VocabParallelHead, model.lm_head.weight[rows.start:rows.stop], None)
    head.group = group
    head.row_counts = [len(layout.vocab_rows(r)) for r in range(layout.tp)]
    model.lm_head = head


def _shard_attention(attn: LlamaAttention, layout: ShardLayout, group: RankGroup) -> None:
    hd = attn.head_dim
    q, kv = layout.q_heads(), layout.kv_heads()
    rows = torch.cat([
        torch.arange(q.start * hd, q.stop * hd),
        attn.q_size + torch.arange(kv.start * hd, kv.stop * hd),
        attn.q_size + attn.kv_size + torch.arange(kv.start * hd, kv.stop * hd),
    ])
    qkv = attn.qkv_proj
    attn.qkv_proj = _linear(Linear, qkv.weight[rows], None if qkv.bias is None else qkv.bias[rows])
    o = attn.o_proj
    attn.o_proj = _row_parallel(o.weight[:, q.start * hd:q.stop * hd], o.bias, layout, group)
    attn.num_heads, attn.num_kv_heads = len(q), len(kv)
    attn.q_size, attn.kv_size = len(q) * hd, len(kv) * hd


def _shard_mlp(mlp: LlamaMLP, layout: ShardLayout, group: RankGroup) -> None:
    cols = layout.mlp_columns()
    rows = torch.cat([torch.arange(cols.start, cols.stop), mlp.intermediate_size + torch.arange(cols.start, cols.stop)])
    gate_up = mlp.gate_up_proj
    mlp.gate_up_proj = _linear(Linear, gate_up.weight[rows], None if gate_up.bias is None else gate_up.bias[rows])
    down = mlp.down_proj
    mlp.down_proj = _row_parallel(down.weight[:, cols.start:cols.stop], down.bias, layout, group)
    mlp.intermediate_size = len(cols)


def _row_parallel(weight: torch.Tensor, bias: torch.Tensor | None, layout: ShardLayout,
                  group: RankGroup) -> RowParallelLinear:
    if bias is not None and layout.rank != 0:
        bias = torch.zeros_like(bias)
    layer = _linear(RowParallelLinear, weight.contiguous(), bias)
    layer.group = group
    return layer


def _linear(cls: type[Linear], weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    """A ``cls`` holding ``weight`` [out, in] and ``bias`` [out] (no fresh allocation)."""
    with torch.device("meta"):
        layer = cls(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
    return layer
