"""engine.model.llama: fuse_checkpoint (transformers' separate projections -> the engine's fused
qkv_proj / gate_up_proj) and RMSNorm against transformers' own."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import cpu_elementwise
from engine.model.llama import RMSNorm, fuse_checkpoint


def t(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def hand_made_state() -> dict[str, torch.Tensor]:
    """Two layers: 2 query rows, 1 key row, 1 value row of width 2; gate/up of 2 rows each;
    layer 0's attention has biases, layer 1's does not."""
    state = {}
    for layer in (0, 1):
        p = f"model.layers.{layer}."
        base = 100.0 * layer
        state[p + "self_attn.q_proj.weight"] = t([base + 1, 2], [3, 4])
        state[p + "self_attn.k_proj.weight"] = t([base + 5, 6])
        state[p + "self_attn.v_proj.weight"] = t([base + 7, 8])
        state[p + "self_attn.o_proj.weight"] = t([9, 10], [11, 12])
        state[p + "mlp.gate_proj.weight"] = t([base + 13, 14], [15, 16])
        state[p + "mlp.up_proj.weight"] = t([base + 17, 18], [19, 20])
        state[p + "mlp.down_proj.weight"] = t([21, 22], [23, 24])
        state[p + "input_layernorm.weight"] = t(1, 1)
    state["model.layers.0.self_attn.q_proj.bias"] = t(0.1, 0.2)
    state["model.layers.0.self_attn.k_proj.bias"] = t(0.3)
    state["model.layers.0.self_attn.v_proj.bias"] = t(0.4)
    state["model.embed_tokens.weight"] = t([1, 2], [3, 4], [5, 6])
    state["model.norm.weight"] = t(1, 1)
    state["lm_head.weight"] = t([7, 8], [9, 10], [11, 12])
    return state


def test_fuses_weights_and_biases_in_row_order():
    state = hand_made_state()
    fused = fuse_checkpoint(state)
    assert torch.equal(fused["model.layers.0.self_attn.qkv_proj.weight"], t([1, 2], [3, 4], [5, 6], [7, 8]))
    assert torch.equal(fused["model.layers.1.self_attn.qkv_proj.weight"], t([101, 2], [3, 4], [105, 6], [107, 8]))
    assert torch.equal(fused["model.layers.0.self_attn.qkv_proj.bias"], t(0.1, 0.2, 0.3, 0.4))
    assert "model.layers.1.self_attn.qkv_proj.bias" not in fused
    assert torch.equal(fused["model.layers.0.mlp.gate_up_proj.weight"], t([13, 14], [15, 16], [17, 18], [19, 20]))
    assert torch.equal(fused["model.layers.1.mlp.gate_up_proj.weight"],
                       t([113, 14], [15, 16], [117, 18], [19, 20]))


def test_removes_the_parts_and_passes_every_other_key_unchanged():
    state = hand_made_state()
    fused = fuse_checkpoint(state)
    parts = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    assert not [k for k in fused if any(f".{p}." in k for p in parts)]
    others = {k: v for k, v in state.items() if not any(f".{p}." in k for p in parts)}
    assert set(fused) == set(others) | {
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.qkv_proj.bias",
        "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight",
    }
    for key, value in others.items():
        assert fused[key] is value


def test_returns_a_new_dict_and_leaves_the_input_alone():
    state = hand_made_state()
    before = {k: v.clone() for k, v in state.items()}
    fuse_checkpoint(state)
    assert set(state) == set(before)
    assert all(torch.equal(state[k], before[k]) for k in before)


def test_is_idempotent():
    once = fuse_checkpoint(hand_made_state())
    twice = fuse_checkpoint(once)
    assert set(twice) == set(once)
    assert all(torch.equal(twice[k], once[k]) for k in once)


def test_an_incomplete_group_is_left_as_it_is():
    """q_proj without k_proj/v_proj (a truncated checkpoint): nothing to fuse, nothing dropped,
    so the loader's missing-weight check names the problem."""
    state = {"model.layers.0.self_attn.q_proj.weight": t([1, 2]), "model.layers.0.self_attn.v_proj.weight": t([3, 4])}
    assert fuse_checkpoint(state).keys() == state.keys()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens, hidden", [(1, 576), (7, 576), (33, 64)])
def test_rms_norm_equals_transformers_bitwise(num_tokens, hidden, dtype, monkeypatch):
    """The torch forms: float32 takes F.rms_norm, half precision the explicit float32 lines: both
    bitwise equal to transformers' LlamaRMSNorm (which always computes in float32). (The CPU's
    float32 C kernel, which sums the squares in another order, is tested below.)"""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(cpu_elementwise, "usable", lambda x: None)

    gen = torch.Generator().manual_seed(num_tokens)
    x = (3 * torch.randn(num_tokens, hidden, generator=gen)).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    ours, theirs = RMSNorm(hidden, 1e-5).to(dtype), LlamaRMSNorm(hidden, 1e-5).to(dtype)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    out = ours(x)
    assert out.dtype == dtype
    assert torch.equal(out, theirs(x))


@pytest.mark.parametrize("num_tokens, hidden", [(1, 576), (7, 576), (33, 64)])
def test_rms_norm_float32_on_the_cpu_kernel_is_within_an_ulp_of_transformers(num_tokens, hidden):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    if cpu_elementwise.load_kernel() is None:
        pytest.skip("no working C compiler here")
    gen = torch.Generator().manual_seed(num_tokens)
    x = 3 * torch.randn(num_tokens, hidden, generator=gen)
    weight = torch.randn(hidden, generator=gen)
    ours, theirs = RMSNorm(hidden, 1e-5), LlamaRMSNorm(hidden, 1e-5)
    ours.weight.data, theirs.weight.data = weight.clone(), weight.clone()
    with torch.no_grad():
        expected = theirs(x)
        torch.testing.assert_close(ours(x), expected, atol=1e-6, rtol=1e-6)
