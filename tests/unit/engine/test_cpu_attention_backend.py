"""CpuAttentionBackend.forward against the readable TorchAttentionBackend.forward.

Each step brings new K/V that differ from what the cache holds at their slots (stale values of
an earlier owner), so a backend that attends before writing, or reads the step's K/V from the
wrong place, gets a different answer. Both backends write the same slots with the same values:
their caches afterwards must be bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.attention import AttentionMetadata, TorchAttentionBackend
from engine.cpu_attention import CpuAttentionBackend
from engine.kernels.cpu_decode_attention import load_kernel

# fp32 throughout; measured max abs difference over 10 seeds 8.3e-7 (kernel), 5.1e-7 (SDPA fallback).
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 inputs, both sides SDPA in bf16 with different gathers/masks: measured 1.6e-2 over 10 seeds
# (one bf16 ulp for outputs in [2, 4)).
BF16_TOL = dict(atol=3e-2, rtol=3e-2)
BLOCK_SIZE = 4
NUM_KV_HEADS = 2
GROUP = 3
HEAD_DIM = 64


@dataclass
class Step:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim], new (not yet in the cache)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], stale at the new slots
    meta: AttentionMetadata


def make_step(q_lens: list[int], ctx_lens: list[int], dtype=torch.float32, seed: int = 0) -> Step:
    """Sequence i computes its last ``q_lens[i]`` of ``ctx_lens[i]`` tokens this step, its
    blocks shuffled over the cache; the table is padded with 2 spare columns of block 0."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 4
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_lens), max(blocks_per_seq) + 2, dtype=torch.long)
    slots, used = [], 0
    for i, (q_len, ctx, nb) in enumerate(zip(q_lens, ctx_lens, blocks_per_seq)):
        tables[i, :nb] = order[used : used + nb]
        used += nb
        slots += [int(tables[i, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx - q_len, ctx)]
    num_tokens = sum(q_lens)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    query = torch.randn(num_tokens, NUM_KV_HEADS * GROUP, HEAD_DIM, generator=gen)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor([0, *q_lens]).cumsum(0),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.long),
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )
    return Step(query.to(dtype), key.to(dtype), value.to(dtype), kv_cache.to(dtype), meta)


def run(backend, step: Step, scale: float = HEAD_DIM**-0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, the cache after the call); the step's own cache stays untouched."""
    cache = step.kv_cache.clone()
    out = backend.forward(step.query, step.key, step.value, cache, step.meta, scale)
    return out, cache


def backends():
    params = [pytest.param(False, id="sdpa")]
    params.insert(0, pytest.param(True, id="kernel", marks=pytest.mark.skipif(
        load_kernel() is None, reason="the CPU decode kernel does not compile here (no working cc)")))
    return params


# Decode rows of 1 token, exactly a block, a block + 1 and ragged; a 1-token first prompt.
ALL_DECODE = ([1] * 5, [1, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 2, 9])
# decode | uncached 6-token prompt | decode | 5-token chunk after 7 cached tokens | decode |
# 3-token chunk after exactly 2 cached blocks.
MIXED = ([1, 6, 1, 5, 1, 3], [9, 6, 1, 12, 4, 2 * BLOCK_SIZE + 3])


@pytest.mark.parametrize("use_kernel", backends())
@pytest.mark.parametrize("q_lens, ctx_lens", [ALL_DECODE, MIXED], ids=["all-decode", "mixed"])
def test_matches_torch_backend(use_kernel, q_lens, ctx_lens):
    step = make_step(q_lens, ctx_lens, seed=len(q_lens))
    backend = CpuAttentionBackend(use_kernel=use_kernel)
    assert (backend._kernel is not None) == use_kernel
    out, cache = run(backend, step)
    expected, expected_cache = run(TorchAttentionBackend(), step)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    assert torch.equal(cache, expected_cache)
    assert not torch.equal(cache, step.kv_cache)  # the step's K/V were new: something was written


@pytest.mark.parametrize("use_kernel", backends())
def test_only_prompt_chunks(use_kernel):
    """No decode row at all: an uncached prompt and a chunk after cached context."""
    step = make_step([7, 4], [7, 10], seed=5)
    out, cache = run(CpuAttentionBackend(use_kernel=use_kernel), step)
    expected, expected_cache = run(TorchAttentionBackend(), step)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("use_kernel", backends())
def test_every_layer_of_a_step_shares_one_plan(use_kernel):
    """Layers call forward with the same metadata object on their own caches; the row split
    is planned once (for the first) and must serve every later layer."""
    layers = [make_step(*MIXED, seed=s) for s in (1, 2, 3)]  # same shapes, different values
    meta = layers[0].meta
    backend = CpuAttentionBackend(use_kernel=use_kernel)
    reference = TorchAttentionBackend()
    plans = []
    for layer in layers:
        layer.meta = meta  # one block layout for the whole step, as the model runner builds it
        out, cache = run(backend, layer)
        plans.append(backend._plan)
        expected, expected_cache = run(reference, layer)
        torch.testing.assert_close(out, expected, **FP32_TOL)
        assert torch.equal(cache, expected_cache)
    plan = plans[0]
    assert all(p is plan for p in plans)
    next_step = make_step(*ALL_DECODE, seed=9)  # a new step's metadata: planned afresh
    out, _ = run(backend, next_step)
    assert backend._plan is not plan and backend._plan.all_decode
    torch.testing.assert_close(out, run(reference, next_step)[0], **FP32_TOL)


@pytest.mark.parametrize("q_lens, ctx_lens", [ALL_DECODE, MIXED], ids=["all-decode", "mixed"])
def test_bfloat16_matches_sdpa(q_lens, ctx_lens):
    """bfloat16 K/V through the kernels (decode rows and prompt chunks) against SDPA in bfloat16."""
    step = make_step(q_lens, ctx_lens, dtype=torch.bfloat16, seed=2)
    out, cache = run(CpuAttentionBackend(use_kernel=True), step)
    expected, expected_cache = run(TorchAttentionBackend(), step)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), **BF16_TOL)
    assert torch.equal(cache, expected_cache)
