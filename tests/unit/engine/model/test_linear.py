"""engine.model.linear.Linear: prepacked (MKL packed float32 GEMM) and plain, against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model.linear import Linear, can_prepack, prepack_linears

# The packed GEMM may sum the K=96 products in another order than F.linear's; measured here:
# bitwise equal (max abs difference 0) for outputs of order 10 (inputs and weights ~N(0, 1)).
FP32_TOL = dict(atol=1e-5, rtol=1e-5)
IN, OUT = 96, 80

needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")


def make_linear(bias: bool, dtype=torch.float32, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(IN, OUT, bias=bias)
    layer.weight.data = torch.randn(OUT, IN, generator=gen).to(dtype)
    if bias:
        layer.bias.data = torch.randn(OUT, generator=gen).to(dtype)
    return layer


@needs_mkl
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 100])
def test_packed_equals_f_linear(num_tokens, bias):
    layer = make_linear(bias, seed=num_tokens)
    assert layer.prepack() is True and layer.packed_weight is not None
    x = torch.randn(num_tokens, IN, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (num_tokens, OUT) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **FP32_TOL)


@needs_mkl
def test_packed_layer_takes_non_2d_inputs_unpacked():
    """The packed GEMM is 2-D only; a [batch, tokens, in] input goes through F.linear, exactly."""
    layer = make_linear(bias=True)
    layer.prepack()
    x = torch.randn(2, 5, IN)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_layer_stays_unpacked(dtype):
    layer = make_linear(bias=True, dtype=dtype)
    assert not can_prepack(layer.weight)
    assert layer.prepack() is False and layer.packed_weight is None
    x = torch.randn(7, IN).to(dtype)
    out = layer(x)
    assert out.dtype == dtype
    assert torch.equal(out, F.linear(x, layer.weight, layer.bias))


@needs_mkl
def test_float32_input_on_a_packed_layer_of_another_weight():
    """prepack(weight) packs the given tensor (the tied LM head passes the embedding's)."""
    layer = make_linear(bias=False)
    other = torch.randn(OUT, IN)
    layer.prepack(other)
    x = torch.randn(4, IN)
    torch.testing.assert_close(layer(x), F.linear(x, other), **FP32_TOL)


@needs_mkl
def test_prepack_linears_packs_every_float32_linear_only():
    model = torch.nn.Sequential(make_linear(True), torch.nn.ReLU(), make_linear(False, seed=1),
                                make_linear(True, dtype=torch.bfloat16), torch.nn.Linear(4, 4))
    assert prepack_linears(model) == 2
    assert [getattr(m, "packed_weight", None) is not None for m in model] == [True, False, True, False, False]


@needs_mkl
def test_packed_linear_under_torch_compile():
    """Under torch.compile the packed GEMM is the opaque custom op tandem::packed_linear; dynamic
    shapes, so one graph serves every number of tokens."""
    layer = make_linear(bias=True)
    layer.prepack()
    graphs = torch._dynamo.explain(layer)(torch.randn(3, IN)).graphs
    assert "torch.ops.tandem.packed_linear" in graphs[0].code and "linear(" not in graphs[0].code.replace(
        "packed_linear(", "")
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for num_tokens in (3, 16, 5):
        x = torch.randn(num_tokens, IN)
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias), **FP32_TOL)
