"""--quantization fp8 (engine.model.fp8_linear): float8 e4m3 weights per output channel, input
rows per token, on the CPU through the dequantised reference (the CUDA path is
``torch._scaled_mm``, which torch's CPU build also runs: the two are compared here)."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.model.fp8_linear import (FP8_DTYPE, FP8_MAX, check_cuda_fp8, dequantize_fp8, fp8_linear, quantize_fp8,
                                     quantize_rows_fp8)
from engine.model.linear import Linear
from engine.model.linear_chooser import LinearSetup
from engine.model.loader import load_model
from tests.factories import engine_logits
from tests.unit.engine.model.test_loader import MAX_POSITIONS, PROMPT, save_tiny_llama


def test_weights_quantise_per_channel_within_e4m3s_rounding():
    torch.manual_seed(0)
    weight = torch.randn(48, 80) * torch.logspace(-3, 1, 48)[:, None]  # channels of very different scales
    weight[7] = 0.0
    qweight, scale = quantize_fp8(weight)
    assert qweight.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (48,)
    torch.testing.assert_close(scale[torch.arange(48) != 7], weight.abs().amax(1)[torch.arange(48) != 7] / FP8_MAX)
    assert torch.equal(qweight[7].float(), torch.zeros(80))
    assert qweight.float().abs().amax() == FP8_MAX  # each channel's largest weight maps to 448
    error = (dequantize_fp8(qweight, scale) - weight).abs()
    # 3 mantissa bits, round to nearest: half an ulp is 2^-4 of the value (normal) or 2^-10 of
    # the scale (subnormal).
    assert (error <= weight.abs() * 2**-4 + scale[:, None] * 2**-10 + 1e-12).all()
    assert error.max() > 0


def test_rows_quantise_on_their_own_scale():
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [1000.0, 1.0, -3.0]])
    xq, scale = quantize_rows_fp8(x)
    torch.testing.assert_close(scale[[0, 2], 0], torch.tensor([2.0, 1000.0]) / FP8_MAX)
    assert torch.equal(xq[1].float(), torch.zeros(3))  # a zero row stays zero (no 0/0)
    assert xq[0, 1].float() == -FP8_MAX and xq[2, 0].float() == FP8_MAX


def test_the_reference_equals_torchs_scaled_mm():
    """The CPU reference and ``torch._scaled_mm`` with row-wise scales (the CUDA call, run by
    torch's CPU build) give the same GEMM up to float32 summation order."""
    torch.manual_seed(1)
    weight, bias = torch.randn(96, 64) * 0.05, torch.randn(96)
    x = torch.randn(5, 64)
    qweight, scale = quantize_fp8(weight)
    xq, x_scale = quantize_rows_fp8(x)
    scaled_mm = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale.view(1, -1),
                                 out_dtype=torch.float32) + bias
    torch.testing.assert_close(fp8_linear(x, qweight, scale, bias), scaled_mm, atol=1e-5, rtol=1e-5)
    # and both are the float32 GEMM of the rounded operands
    torch.testing.assert_close(scaled_mm, (xq.float() * x_scale) @ dequantize_fp8(qweight, scale).t() + bias,
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loader_quantises_every_linear_layer_to_fp8(tmp_path, dtype):
    """A tiny tied-head model: every Linear (the LM head too) holds float8 weights, no plan and
    no float weight; the logits equal the model given the dequantised weights whose layers round
    their input rows through float8 the same way."""
    save_tiny_llama(tmp_path, tie_word_embeddings=True, attention_bias=True)
    torch_dtype = getattr(torch, dtype)
    reference = load_model(tmp_path, dtype, "cpu", MAX_POSITIONS, linear=None)
    for layer in [m for m in reference.modules() if isinstance(m, Linear)]:
        qweight, scale = quantize_fp8(layer.weight)
        layer.weight = torch.nn.Parameter(dequantize_fp8(qweight, scale), requires_grad=False)
        if layer.bias is not None:
            layer.bias = torch.nn.Parameter(layer.bias.float(), requires_grad=False)
        layer.register_forward_pre_hook(lambda module, args: (_rounded(args[0]),))
        layer.register_forward_hook(lambda module, args, out: out.to(torch_dtype))
    model = load_model(tmp_path, dtype, "cpu", MAX_POSITIONS, LinearSetup("auto", use_cache=False), quantization="fp8")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1
    assert all(m.fp8_weight is not None and m.weight is None and m.plan is None for m in linears)
    assert "fp8" in repr(model.lm_head) and model.model.embed_tokens.weight.dtype == torch_dtype
    backend = CpuAttentionBackend()
    torch.testing.assert_close(engine_logits(model, PROMPT, backend), engine_logits(reference, PROMPT, backend),
                               atol=1e-4, rtol=1e-5)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    xq, scale = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    return (xq.float() * scale).reshape(x.shape)


def test_fp8_is_refused_off_cuda_with_the_modes_that_run_there():
    with pytest.raises(ValueError, match=r"quantization 'fp8' runs on CUDA GPUs with float8 GEMMs \(compute "
                                         r"capability 8.9 or later\), not on device 'cpu': use 'int8' or 'w8a16' there"):
        EngineConfig(quantization="fp8")
    assert EngineConfig(quantization="fp8", device="cuda", dtype="bfloat16").quantization == "fp8"
    with pytest.raises(ValueError, match="fp8 weights run on CUDA GPUs with float8 GEMMs, not on 'cpu'"):
        check_cuda_fp8("cpu", [(576, 576)])
