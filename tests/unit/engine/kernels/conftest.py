"""Kernel tests: each Triton or C kernel against its readable torch reference, on small random data.

Without CUDA the kernels run under Triton's interpreter, which must be on before any kernel
module is imported (``triton.jit`` decides at decoration time): this conftest is loaded before
the test modules here, so it switches it on first. Shapes stay small: the interpreter runs each
program and loop iteration in Python.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# The Triton kernels' tests need triton; the C kernels' tests here do not, so a machine without
# triton skips only the former (listed by the kernel modules they import).
TRITON_TESTS = ["test_block_copy_kernel.py", "test_kv_cache_write_kernel.py", "test_paged_decode_attention_kernel.py",
                "test_paged_prefill_attention_kernel.py", "test_triton_attention_backend.py", "test_triton_kv8.py"]
collect_ignore = [] if importlib.util.find_spec("triton") else TRITON_TESTS

from engine.attention import AttentionMetadata  # noqa: E402
from engine.kernels.cpu_decode_attention import load_kernel  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class PagedBatch:
    """A step's worth of paged attention inputs; the cache already holds every context token."""

    kv_cache: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim], random
    meta: AttentionMetadata  # slot_mapping: the slots of each sequence's last q_len tokens
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]


def make_paged_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Random cache with spare blocks, each sequence on shuffled (non-contiguous) blocks."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks hold garbage no kernel may read
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(ctx_lens), max(blocks_per_seq), dtype=torch.long)
    slots: list[int] = []
    used = 0
    for i, (q_len, ctx, nb) in enumerate(zip(q_lens, ctx_lens, blocks_per_seq)):
        tables[i, :nb] = order[used : used + nb]
        used += nb
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(ctx - q_len, ctx)]
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=DEVICE),
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.long).cumsum(0),
        seq_lens=torch.tensor(ctx_lens, dtype=torch.long),
        block_tables=tables.to(DEVICE),
        max_query_len=max(q_lens),
        max_seq_len=max(ctx_lens),
    )
    return PagedBatch(kv_cache.to(DEVICE), meta, query.to(DEVICE))


def cached_kv(batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """This step's K/V as the cache already holds them, so a reference write changes nothing."""
    num_kv_heads, head_dim = batch.kv_cache.shape[-2:]
    k = batch.kv_cache[0].reshape(-1, num_kv_heads, head_dim)[batch.meta.slot_mapping]
    v = batch.kv_cache[1].reshape(-1, num_kv_heads, head_dim)[batch.meta.slot_mapping]
    return k, v


@pytest.fixture(scope="session")
def decode_kernel():
    """The compiled C paged decode kernel (``engine/kernels/cpu/paged_decode_attention.c``), for
    its float and 8-bit tests; they skip where it does not compile."""
    lib = load_kernel()
    if lib is None:
        pytest.skip("the CPU decode kernel does not compile on this machine (no working cc)")
    return lib


@pytest.fixture
def device() -> torch.device:
    return DEVICE


@pytest.fixture
def paged_batch():
    """Factory: :func:`make_paged_batch`."""
    return make_paged_batch


@pytest.fixture
def reference_attention():
    """``(batch, scale) -> [num_tokens, num_heads, head_dim]`` from the torch backend, on a copy
    of the cache (its write of :func:`cached_kv` is a no-op anyway)."""
    from engine.attention import TorchAttentionBackend

    def run(batch: PagedBatch, scale: float) -> torch.Tensor:
        k, v = cached_kv(batch)
        query = batch.query.float()
        cache = batch.kv_cache.float()
        return TorchAttentionBackend().forward(query, k.float(), v.float(), cache, batch.meta, scale)

    return run
