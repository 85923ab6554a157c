"""The decode layer stack (engine/kernels/cpu/decode_layers.c) against the eager layer loop it
replaces: the same hidden states and the same KV cache, bit for bit, on a random Llama; and the
passes it must leave to the loop."""

from __future__ import annotations

import pytest
import torch

from engine.attention import ForwardContext, forward_context
from engine.cpu_attention import CpuAttentionBackend
from engine.kernels import cpu_decode_layers
from engine.model.linear import Linear, planned_layers
from engine.model.llama import LlamaForCausalLM, LlamaModel

from .conftest import make_paged_batch

NUM_BUCKETS = 12


def tiny_llama(head_dim: int, bias: bool, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A random Llama (3 layers, GQA 4:2) in ``dtype`` whose weights have values of every size."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=300, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, rms_norm_eps=1e-5,
                         attention_bias=bias)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config, max_positions=256)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.to(dtype).eval()


def plan(model: LlamaForCausalLM, *schedules: str) -> None:
    """Every layer GEMM on ``schedules`` in turn (layer after layer), at every M bucket."""
    for i, layer in enumerate(planned_layers(model.model)):
        layer.set_plan((schedules[i % len(schedules)],) * NUM_BUCKETS)


def decode_step(num_seqs: int, head_dim: int, seed: int, dtype: torch.dtype = torch.float32):
    """A decode step of ``num_seqs`` sequences (contexts 1-70 tokens, shuffled 4-token blocks):
    (kv caches per layer, metadata, positions)."""
    ctx_lens = [1 + (17 * i + 5 * seed) % 70 for i in range(num_seqs)]
    batch = make_paged_batch([1] * num_seqs, ctx_lens, num_kv_heads=2, group=2, head_dim=head_dim, block_size=4,
                             seed=seed)
    caches = torch.stack([batch.kv_cache * (1 + layer) for layer in range(3)]).to(dtype)  # [layers, 2, blocks, ...]
    return caches, batch.meta, torch.tensor(ctx_lens) - 1


def run_layers(model: LlamaForCausalLM, fused: bool, caches: torch.Tensor, meta, positions, input_ids):
    """LlamaModel.forward on a copy of ``caches``: (hidden [M, hidden], the caches after)."""
    caches = caches.clone()
    LlamaModel.fused_decode_layers = fused
    try:
        with torch.inference_mode(), forward_context(ForwardContext(meta, CpuAttentionBackend(), list(caches.unbind(0)))):
            return model.model(input_ids, positions), caches
    finally:
        LlamaModel.fused_decode_layers = True


@pytest.fixture(scope="module")
def stack_kernel():
    if cpu_decode_layers.load_kernel() is None:
        pytest.skip("the CPU kernels do not compile on this machine (no working cc)")


@pytest.mark.parametrize("num_seqs", [1, 3, 16])
@pytest.mark.parametrize("head_dim,bias,schedules,dtype", [
    (64, False, ("fp32_cpu",), torch.float32),
    (64, True, ("fp32_stream", "fp32_cpu"), torch.float32),  # Qwen2-style QKV bias; both schedules in one pass
    (16, False, ("fp32_stream",), torch.float32),  # the attention kernel's scalar path
    (64, True, ("fp32_cpu",), torch.bfloat16),  # bf16_linear; the residuals rounded to bfloat16
], ids=["hd64", "hd64-bias-mixed", "hd16", "bf16"])
def test_equals_the_layer_loop_bit_for_bit(stack_kernel, num_seqs, head_dim, bias, schedules, dtype):
    model = tiny_llama(head_dim, bias, dtype=dtype)
    plan(model, *schedules)
    caches, meta, positions = decode_step(num_seqs, head_dim, seed=num_seqs, dtype=dtype)
    input_ids = torch.arange(num_seqs) * 7 % 300
    stack = model.model._decode_stack()
    assert stack is not None
    calls = []
    real_run = stack.run
    stack.run = lambda *args: calls.append(real_run(*args)) or calls[-1]
    fused, fused_caches = run_layers(model, True, caches, meta, positions, input_ids)
    assert calls and calls[0] is not None  # the pass went through the C stack
    loop, loop_caches = run_layers(model, False, caches, meta, positions, input_ids)
    assert torch.equal(fused, loop)
    assert torch.equal(fused_caches, loop_caches)
    assert not torch.equal(loop_caches, caches)  # the step's K/V were written


def test_passes_left_to_the_layer_loop(stack_kernel):
    """A prompt chunk, a GEMM on another backend, and a float16 model run the loop, unchanged."""
    model = tiny_llama(64, False)
    plan(model, "fp32_cpu")
    stack = model.model._decode_stack()
    caches, meta, positions = decode_step(4, 64, seed=1)
    context = ForwardContext(meta, CpuAttentionBackend(), list(caches.unbind(0)))
    hidden = torch.randn(4, 256)
    rope = model.model.rotary.tables(positions, torch.float32)
    with torch.inference_mode():
        assert stack.run(hidden, *rope, context) is not None
        prompt = make_paged_batch([3, 1, 1, 1], [5, 9, 2, 30], 2, 2, 64, 4)
        prompt_context = ForwardContext(prompt.meta, CpuAttentionBackend(), list(caches.unbind(0)))
        assert stack.run(torch.randn(6, 256), *model.model.rotary.tables(torch.arange(6), torch.float32),
                         prompt_context) is None
        model.model.layers[1].mlp.down_proj.set_plan(("onednn",) * NUM_BUCKETS)
        before = caches.clone()
        assert stack.run(hidden, *rope, context) is None
        assert torch.equal(caches, before)
    assert cpu_decode_layers.DecodeLayerStack.for_model(tiny_llama(64, False, dtype=torch.float16).model) is None


def test_tensor_parallel_layers_are_not_taken():
    """A row-parallel o_proj (a Linear subclass with an all-reduce) keeps the model on the loop."""
    model = tiny_llama(64, False)

    class RowParallel(Linear):
        pass

    layer = model.model.layers[0].self_attn
    replacement = RowParallel(layer.o_proj.in_features, layer.o_proj.out_features)
    replacement.weight = layer.o_proj.weight
    layer.o_proj = replacement
    assert cpu_decode_layers.DecodeLayerStack.for_model(model.model) is None
