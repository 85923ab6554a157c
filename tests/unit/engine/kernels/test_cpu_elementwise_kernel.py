"""engine.kernels.cpu_elementwise: RMSNorm, the rotary embedding and SiLU x up in C against the
torch forms engine.model.llama keeps for other devices and dtypes (the rotary bitwise), on decode
and prefill row counts (the second past the kernels' threading threshold), and the checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import cpu_elementwise
from engine.model.llama import RotaryEmbedding, _rotate_half

# A sum of 576 squares in another order than torch's reduction, then a square root: measured max
# relative difference ~1.2e-7 (one float32 ulp); libm's expf against torch's vectorised exp in
# SiLU: ~2.4e-7 relative.
TOL = dict(atol=1e-6, rtol=1e-6)


@pytest.fixture(scope="module")
def kernel():
    lib = cpu_elementwise.load_kernel()
    if lib is None:
        pytest.skip("no working C compiler here")
    return lib


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("dim", [576, 77])
def test_rms_norm_equals_torch(kernel, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x, w = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    out = cpu_elementwise.rms_norm(kernel, x, w, 1e-5)
    torch.testing.assert_close(out, F.rms_norm(x, (dim,), w, 1e-5), **TOL)
    variance = x.pow(2).mean(-1, keepdim=True)  # transformers' LlamaRMSNorm
    torch.testing.assert_close(out, w * (x * torch.rsqrt(variance + 1e-5)), **TOL)


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_rotary_in_place_is_bitwise_the_torch_form_on_the_fused_qkv_view(kernel, tokens):
    gen = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim // 2, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [T, 1, D] as RotaryEmbedding.tables
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    expected = qk * cos + _rotate_half(qk) * sin
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    out = cpu_elementwise.rotary_(kernel, qk, cos, sin)
    assert out.data_ptr() == qkv.data_ptr()  # in place
    assert torch.equal(out, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # V untouched


def test_rotary_embedding_apply_takes_the_kernel_for_float32_cpu(kernel):
    x = torch.randn(4, 3, 8)
    cos, sin = torch.rand(4, 1, 8), torch.rand(4, 1, 8)
    expected = x * cos + _rotate_half(x) * sin
    assert torch.equal(RotaryEmbedding.apply(x, cos, sin), expected)
    assert torch.equal(x, expected)  # rotated in place
    xh = torch.randn(4, 3, 8, dtype=torch.float16)
    before = xh.clone()
    RotaryEmbedding.apply(xh, cos.half(), sin.half())
    assert torch.equal(xh, before)  # float16 keeps the torch form (a new tensor)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_silu_mul_equals_torch(kernel, rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4
    gate, up = gate_up.split(1536, dim=-1)
    torch.testing.assert_close(cpu_elementwise.silu_mul(kernel, gate_up), F.silu(gate) * up, **TOL)


@pytest.mark.parametrize("rows", [1, 16, 300])
def test_bfloat16_rms_norm_equals_the_torch_bfloat16_form(kernel, rows):
    """llama.RMSNorm's bfloat16 lines: float32 normalisation, rounded, times the bf16 weight."""
    gen = torch.Generator().manual_seed(rows)
    x, w = (torch.randn(rows, 576, generator=gen) * 3).bfloat16(), torch.randn(576, generator=gen).bfloat16()
    out = cpu_elementwise.rms_norm(kernel, x, w, 1e-5)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert out.dtype == torch.bfloat16
    # a float32 ulp of the scale can move a value across a bf16 rounding boundary: one bf16 step
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2**-7)
    assert (out == expected).float().mean() > 0.99


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_bfloat16_rotary_in_place_is_bitwise_the_torch_bfloat16_form(kernel, tokens):
    gen = torch.Generator().manual_seed(tokens)
    qk = torch.randn(tokens, 12, 64, generator=gen).bfloat16()
    angles = torch.rand(tokens, 32, generator=gen) * 100
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().unsqueeze(1).bfloat16(), emb.sin().unsqueeze(1).bfloat16()
    expected = qk * cos + _rotate_half(qk) * sin
    out = RotaryEmbedding.apply(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr() and out.dtype == torch.bfloat16  # in place
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_over_the_whole_range_and_the_scalar_tail(kernel, dtype):
    """Gates from -100 to 100 (exp(-g) far past float32's range on the negative side), +-0, a row
    width off the vector width (the scalar tail), NaN staying NaN."""
    gate = torch.cat([torch.linspace(-100, 100, 997), torch.tensor([0.0, -0.0, float("nan")])])
    up = torch.linspace(-3, 3, gate.numel())
    gate_up = torch.cat([gate, up]).reshape(1, -1).to(dtype)
    out = cpu_elementwise.silu_mul(kernel, gate_up)[0]
    g, u = gate_up[0].split(gate.numel())
    expected = F.silu(g) * u
    assert out[-1].isnan() and out.dtype == dtype
    torch.testing.assert_close(out[:-1].float(), expected[:-1].float(), atol=1e-6,
                               rtol=1e-6 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("rows", [1, 16, 64])
def test_bfloat16_silu_mul_equals_the_torch_bfloat16_form(kernel, rows):
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate, up = gate_up.split(1536, dim=-1)
    out = cpu_elementwise.silu_mul(kernel, gate_up)
    expected = F.silu(gate) * up
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), atol=1e-6, rtol=2**-7)  # Cephes' expf vs torch's
    assert (out == expected).float().mean() > 0.99


def test_bad_arguments_are_refused(kernel):
    with pytest.raises(ValueError, match="of its dtype only"):
        cpu_elementwise.rms_norm(kernel, torch.randn(2, 8).bfloat16(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match="of one dtype only"):
        cpu_elementwise.rotary_(kernel, torch.randn(2, 3, 8).bfloat16(), torch.rand(2, 8), torch.rand(2, 8))
    with pytest.raises(ValueError, match="float32 or bfloat16 x"):
        cpu_elementwise.rms_norm(kernel, torch.randn(2, 8).double(), torch.randn(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight \[D\]"):
        cpu_elementwise.rms_norm(kernel, torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(ValueError, match="contiguous heads and even D"):
        cpu_elementwise.rotary_(kernel, torch.randn(2, 3, 7), torch.rand(2, 7), torch.rand(2, 7))
    with pytest.raises(ValueError, match="contiguous heads"):
        cpu_elementwise.rotary_(kernel, torch.randn(2, 8, 3).transpose(1, 2), torch.rand(2, 8), torch.rand(2, 8))
    with pytest.raises(ValueError, match="one row of 8 per token"):
        cpu_elementwise.rotary_(kernel, torch.randn(2, 3, 8), torch.rand(3, 8), torch.rand(3, 8))
    with pytest.raises(ValueError, match=r"\[M, 2I\]"):
        cpu_elementwise.silu_mul(kernel, torch.randn(2, 7))


def test_usable_only_for_float32_and_bfloat16_cpu_tensors_without_grad(kernel):
    assert cpu_elementwise.usable(torch.randn(2, 2)) is kernel
    assert cpu_elementwise.usable(torch.randn(2, 2, dtype=torch.bfloat16)) is kernel
    assert cpu_elementwise.usable(torch.randn(2, 2, dtype=torch.float16)) is None
    assert cpu_elementwise.usable(torch.randn(2, 2, requires_grad=True)) is None


@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (16, 49152), (2, 49157)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_argmax_rows_equals_torch(kernel, shape):
    """Random rows (vocabulary-sized, and lengths off the vector width), each row's maximum copied
    to a later place too (torch keeps the first), on one row that is all -inf."""
    gen = torch.Generator().manual_seed(shape[1])
    x = torch.randn(shape, generator=gen)
    first = x.argmax(-1)
    for m in range(shape[0]):
        x[m, shape[1] - 1] = x[m, first[m]]  # a tie after the first maximum
    x[0] = float("-inf") if shape[1] > 1 else x[0]
    out = cpu_elementwise.argmax_rows(kernel, x)
    assert out.dtype == torch.int64 and out.tolist() == x.argmax(-1).tolist()


def test_argmax_rows_takes_the_first_nan_as_torch_does(kernel):
    x = torch.zeros(3, 40)
    x[0, 5], x[0, 30] = 1.0, float("nan")  # NaN after the maximum
    x[1, 33], x[1, 2] = float("nan"), float("nan")  # two NaN: the first, in the scalar tail's reach too
    x[2, 39] = float("nan")  # only in the tail past the vectors
    assert cpu_elementwise.argmax_rows(kernel, x).tolist() == x.argmax(-1).tolist() == [30, 2, 39]


def test_argmax_rows_refuses_what_it_cannot_read(kernel):
    with pytest.raises(ValueError, match="float32"):
        cpu_elementwise.argmax_rows(kernel, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="N >= 1"):
        cpu_elementwise.argmax_rows(kernel, torch.zeros(2, 0))
