"""The CPU paged prefill kernel (C, ``engine/kernels/cpu/paged_prefill_attention.c``) against torch's
``scaled_dot_product_attention`` on the context gathered from the same blocks, with the causal
mask offset by the cached length.

Every slot the chunk may not read (spare blocks, the tail of its last block) holds large garbage
(|x| ~ 1e3): a kernel reading one key past a row's position, or past the context, would move the
result by far more than the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_prefill_attention import load_kernel, paged_prefill_attention_cpu, runs

# Both sides accumulate float32 dot products and softmax in float32, in different orders (the
# kernel uses a vector exp polynomial): max abs error measured 1.7e-6 for values of order 1.
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
GARBAGE = 1e3


@pytest.fixture(scope="module")
def kernel():
    lib = load_kernel()
    if lib is None:
        pytest.skip("the CPU prefill-attention kernel does not compile here (no working cc)")
    return lib


def chunk(q_len, ctx, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0):
    """(query [q_len, H, D] as a strided view of a fused QKV row, kv_cache, blocks): the context's
    ctx tokens on shuffled blocks, garbage everywhere else in the cache."""
    gen = torch.Generator().manual_seed(seed)
    nb = -(-ctx // block_size)
    num_blocks = nb + 3
    blocks = torch.randperm(num_blocks, generator=gen)[:nb].contiguous()
    kv_cache = GARBAGE * torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    for p in range(ctx):
        kv_cache[:, blocks[p // block_size], p % block_size] /= GARBAGE
    fused = torch.randn(q_len, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    return fused[:, :num_heads].to(dtype), kv_cache.to(dtype), blocks


def reference(query, kv_cache, blocks, ctx, scale):
    """SDPA in float32 over the gathered context: [q_len, H, D] float32."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    k = kv_cache[0].index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:ctx].float()
    v = kv_cache[1].index_select(0, blocks).reshape(-1, num_kv_heads, head_dim)[:ctx].float()
    q_len = query.shape[0]
    mask = torch.ones(q_len, ctx, dtype=torch.bool).tril(diagonal=ctx - q_len)
    out = F.scaled_dot_product_attention(query.float().transpose(0, 1)[None], k.transpose(0, 1)[None],
                                         v.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


# (q_len, ctx): one token alone and after context, a block exactly, one past it, the real model's
# mean chunk, a chunk after cached context, a short chunk after a long context.
CHUNKS = [(1, 1), (1, 40), (16, 16), (17, 17), (97, 97), (33, 200), (5, 300)]


@pytest.mark.parametrize("q_len, ctx", CHUNKS)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 128), (4, 1, 32)],
                         ids=["gqa3-d64", "mha-d64", "gqa4-d128", "mqa-d32"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_kernel_matches_sdpa(kernel, q_len, ctx, num_heads, num_kv_heads, head_dim, block_size):
    query, kv_cache, blocks = chunk(q_len, ctx, num_heads, num_kv_heads, head_dim, block_size, seed=q_len + ctx)
    out = paged_prefill_attention_cpu(kernel, query, kv_cache, blocks, ctx, head_dim**-0.5)
    assert out.shape == (q_len, num_heads, head_dim) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(query, kv_cache, blocks, ctx, head_dim**-0.5), **FP32_TOL)


@pytest.mark.parametrize("q_len, ctx", [(17, 17), (33, 200)])
def test_bfloat16_cache_matches_sdpa_on_the_same_values(kernel, q_len, ctx):
    """bfloat16 K/V are widened exactly: against SDPA in float32 on the same bfloat16 values, the
    float32 tolerance holds; a bfloat16 query gives a bfloat16 output rounded once."""
    query, kv_cache, blocks = chunk(q_len, ctx, 9, 3, 64, 16, dtype=torch.bfloat16, seed=3)
    expected = reference(query.float(), kv_cache, blocks, ctx, 0.125)
    out = paged_prefill_attention_cpu(kernel, query.float(), kv_cache, blocks, ctx, 0.125)
    torch.testing.assert_close(out, expected, **FP32_TOL)
    out_bf16 = paged_prefill_attention_cpu(kernel, query, kv_cache, blocks, ctx, 0.125)
    assert out_bf16.dtype == torch.bfloat16
    assert torch.equal(out_bf16, out.to(torch.bfloat16))  # the float32 result, rounded once


@pytest.mark.parametrize("spread", [30.0, 300.0])
def test_softmax_over_scores_far_apart(kernel, spread):
    """Scores hundreds apart: the largest dominates, the rest underflow to 0, nothing overflows."""
    query, kv_cache, blocks = chunk(20, 50, 4, 2, 64, 16, seed=7)
    query = query * spread
    out = paged_prefill_attention_cpu(kernel, query, kv_cache, blocks, 50, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, reference(query, kv_cache, blocks, 50, 0.125), **FP32_TOL)


def test_runs_only_where_the_vector_path_does(kernel):
    cache = torch.zeros(2, 4, 16, 2, 64)
    query = torch.zeros(3, 4, 64)
    assert runs(kernel, query, cache)
    assert not runs(None, query, cache)
    assert not runs(kernel, query, cache.half())
    assert not runs(kernel, query, torch.zeros(2, 4, 16, 2, 40))  # head_dim not a multiple of 16
    assert not runs(kernel, query, torch.zeros(2, 4, 16, 2, 256))  # past 128
    assert not runs(kernel, query, cache.transpose(3, 4))  # not contiguous


def test_rejects_what_would_read_past_a_tensor(kernel):
    query, kv_cache, blocks = chunk(8, 20, 4, 2, 64, 16)
    scale = 0.125
    with pytest.raises(ValueError, match="q_len"):
        paged_prefill_attention_cpu(kernel, query, kv_cache, blocks, 7, scale)  # ctx < q_len
    with pytest.raises(ValueError, match="q_len"):
        paged_prefill_attention_cpu(kernel, query, kv_cache, blocks[:1], 20, scale)  # table covers 16 < 20
    with pytest.raises(ValueError, match="int64"):
        paged_prefill_attention_cpu(kernel, query, kv_cache, blocks.int(), 20, scale)
    with pytest.raises(ValueError, match="does not fit"):
        paged_prefill_attention_cpu(kernel, query[:, :3], kv_cache, blocks, 20, scale)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="does not fit"):
        paged_prefill_attention_cpu(kernel, query.transpose(0, 1), kv_cache, blocks, 20, scale)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        paged_prefill_attention_cpu(kernel, query, kv_cache.half(), blocks, 20, scale)
