"""engine.kernels.cpu_fp32_linear: the C kernel against F.linear on every path of the kernel (M of
one row up to several blocks of micro-kernel rows, every block height; output channels in whole
panels and a partial last panel; odd K), in float32 and bfloat16, the packed layout, and the
wrapper's argument checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_fp32_linear import bind_fp32_linear, fp32_linear_cpu, load_kernel, pack_weight

# Float32 sums of K <= 1536 products of magnitude ~1 (outputs ~40), in another order than
# F.linear's (and fused multiply-adds): measured max abs difference ~1.5e-5 (relative ~4e-7).
FP32_TOL = dict(atol=2e-4, rtol=1e-5)
# bfloat16: the float32 sum rounded once to bfloat16. Against the float32 GEMM of the same bf16
# values rounded once, a sum on the other side of a rounding boundary (sums ~1e-5 apart) lands
# one bf16 step away: 2^-7 relative at most (8 significant bits), or the float32 tolerance near zero.
BF16_TOL = dict(atol=2e-4, rtol=2**-7)


@pytest.fixture(scope="module")
def kernel():
    lib = load_kernel()
    if lib is None:
        pytest.skip("no working C compiler here")
    return lib


def make(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(960, 576), (576, 576), (3072, 576), (576, 1536), (50, 24), (7, 13), (33, 1)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 6, 7, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_kernel_equals_f_linear(kernel, shape, num_tokens, bias):
    weight = make(*shape, seed=shape[0] + num_tokens)
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
    b = torch.randn(shape[0]) if bias else None
    out = fp32_linear_cpu(kernel, x, pack_weight(kernel, weight), shape[0], b)
    assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, b), **FP32_TOL)


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (50, 24), (7, 13), (33, 1), (96, 200)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 2, 7, 8, 9, 16, 17, 24, 33, 40])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_streaming_schedule_gives_the_same_result_bit_for_bit(kernel, shape, num_tokens, bias):
    """fp32_linear_stream sums the same products in the same order as fp32_linear: K chunks of 64
    rows (K = 1, 13, 200 and 576 leave a partial last chunk or none), row groups of two blocks (M
    past 16 takes several), prefetches stopped before the end of the packed weight."""
    weight = make(*shape, seed=shape[0] + num_tokens)
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
    b = torch.randn(shape[0]) if bias else None
    packed = pack_weight(kernel, weight)
    out = fp32_linear_cpu(kernel, x, packed, shape[0], b, stream=True)
    assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.float32
    assert torch.equal(out, fp32_linear_cpu(kernel, x, packed, shape[0], b))
    torch.testing.assert_close(out, F.linear(x, weight, b), **FP32_TOL)


def test_the_streaming_schedule_is_float32_only(kernel):
    weight = make(40, 32, seed=3).bfloat16()
    with pytest.raises(ValueError, match="float32 only"):
        bind_fp32_linear(kernel, pack_weight(kernel, weight), 32, 40, None, torch.bfloat16, stream=True)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (50, 24), (7, 13)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 3, 6, 8, 16, 17])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_bfloat16_equals_the_float32_gemm_of_its_values_rounded_once(kernel, shape, num_tokens, bias):
    weight = make(*shape, seed=shape[0] + num_tokens).bfloat16()
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens)).bfloat16()
    b = torch.randn(shape[0]).bfloat16() if bias else None
    out = fp32_linear_cpu(kernel, x, pack_weight(kernel, weight), shape[0], b)
    assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float(), None if b is None else b.float()).bfloat16()
    torch.testing.assert_close(out.float(), expected.float(), **BF16_TOL)
    # most outputs are bitwise the single rounding of the float32 sum
    assert (out == expected).float().mean() > 0.95


def test_bfloat16_rounds_to_nearest_even_and_keeps_nan_and_inf(kernel):
    """One input channel, so each output is exactly x * w in float32 before the rounding."""
    values = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.0e38, float("nan"), float("inf")])
    weight = torch.ones(values.numel(), 1, dtype=torch.bfloat16)
    # x * 1 is exact; the bias adds the float32 part a bfloat16 input cannot carry
    bias = torch.zeros(values.numel(), dtype=torch.bfloat16)
    x = torch.ones(1, 1, dtype=torch.bfloat16)
    out = fp32_linear_cpu(kernel, x, pack_weight(kernel, weight * 0 + values[:, None].bfloat16()), values.numel(), bias)
    torch.testing.assert_close(out[0], values.bfloat16(), rtol=0, atol=0, equal_nan=True)
    halfway = fp32_linear_cpu(kernel, torch.tensor([[1.0, 2**-8]], dtype=torch.bfloat16),
                              pack_weight(kernel, torch.ones(1, 2, dtype=torch.bfloat16)), 1, None)
    assert halfway.item() == 1.0  # 1 + 2^-8 is halfway between 1 and 1 + 2^-7: to the even one, 1
    above = fp32_linear_cpu(kernel, torch.tensor([[1.0, 3 * 2**-8]], dtype=torch.bfloat16),
                            pack_weight(kernel, torch.ones(1, 2, dtype=torch.bfloat16)), 1, None)
    assert above.item() == 1.0 + 2**-6  # 1 + 3 * 2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6


def test_the_lm_head_shape_at_decode_batches(kernel):
    weight = make(49152, 576, seed=5)
    packed = pack_weight(kernel, weight)
    for num_tokens in (1, 16):
        x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(num_tokens))
        torch.testing.assert_close(fp32_linear_cpu(kernel, x, packed, 49152, None), F.linear(x, weight), **FP32_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packed_layout_is_panels_of_channels_padded_with_zeros(kernel, dtype):
    width = kernel.fp32_linear_panel_width()
    assert width in (8, 16, 32)  # two vectors: SSE-width generic, AVX2, AVX-512
    weight = make(width + 3, 5, seed=1).to(dtype)
    packed = pack_weight(kernel, weight)
    if dtype == torch.bfloat16 and kernel.bf16_pairs:  # AVX512-BF16: [panels][K'/2][NR][2], K' = 6
        assert packed.shape == (2, 6, width)
        pairs = packed.view(2, 3, width, 2)  # pairs[p, kk, j, t] = w[p * NR + j, 2 kk + t]
        unpaired = pairs.permute(0, 1, 3, 2).reshape(2, 6, width)[:, :5]  # back to [panels][K][NR]
        torch.testing.assert_close(unpaired[0], weight[:width].t(), rtol=0, atol=0)
        torch.testing.assert_close(unpaired[1, :, :3], weight[width:].t(), rtol=0, atol=0)
        assert torch.count_nonzero(unpaired[1, :, 3:]) == 0 and torch.count_nonzero(pairs[:, 2, :, 1]) == 0  # K pad
        return
    assert packed.shape == (2, 5, width)
    torch.testing.assert_close(packed[0], weight[:width].t(), rtol=0, atol=0)
    torch.testing.assert_close(packed[1, :, :3], weight[width:].t(), rtol=0, atol=0)
    assert torch.count_nonzero(packed[1, :, 3:]) == 0


def test_a_non_contiguous_input_is_read_as_its_values(kernel):
    weight = make(40, 32, seed=3)
    x = torch.randn(32, 4).t()  # [4, 32], column-major
    torch.testing.assert_close(fp32_linear_cpu(kernel, x, pack_weight(kernel, weight), 40, None),
                               F.linear(x, weight), **FP32_TOL)


def test_zero_rows_give_an_empty_result(kernel):
    out = fp32_linear_cpu(kernel, torch.empty(0, 8), pack_weight(kernel, make(20, 8, seed=0)), 20, None)
    assert out.shape == (0, 20)


def test_bad_arguments_are_refused_before_the_c_code_runs(kernel):
    weight = make(20, 8, seed=0)
    packed = pack_weight(kernel, weight)
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        fp32_linear_cpu(kernel, x.double(), packed, 20, None)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        fp32_linear_cpu(kernel, x.bfloat16(), packed, 20, None)  # a float32 weight with bf16 input
    with pytest.raises(ValueError, match="do not fit"):
        fp32_linear_cpu(kernel, torch.randn(2, 9), packed, 20, None)  # K differs
    with pytest.raises(ValueError, match="do not fit"):
        fp32_linear_cpu(kernel, x, packed, 20 + 2 * kernel.fp32_linear_panel_width(), None)  # N past the panels
    with pytest.raises(ValueError, match="do not fit"):
        fp32_linear_cpu(kernel, x, packed, 20, torch.randn(19))
    with pytest.raises(ValueError, match="contiguous"):
        fp32_linear_cpu(kernel, x, packed.transpose(1, 2).contiguous().transpose(1, 2), 20, None)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16 CPU weight"):
        pack_weight(kernel, weight.double())


def test_a_bound_linear_checks_its_weight_once_and_each_x(kernel):
    """bind_fp32_linear: the packed weight and bias are checked when bound; every call then checks
    x alone (dtype, rank, K) and equals the unbound call bit for bit."""
    weight, bias = make(20, 8, seed=1), torch.randn(20)
    packed = pack_weight(kernel, weight)
    with pytest.raises(ValueError, match="do not fit"):
        bind_fp32_linear(kernel, packed, 9, 20, bias, torch.float32)  # K differs from the panels'
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        bind_fp32_linear(kernel, packed, 8, 20, bias.bfloat16(), torch.float32)
    call = bind_fp32_linear(kernel, packed, 8, 20, bias, torch.float32)
    x = torch.randn(5, 8)
    assert torch.equal(call(x), fp32_linear_cpu(kernel, x, packed, 20, bias))
    for bad in (torch.randn(5, 9), x.bfloat16(), torch.randn(8)):
        with pytest.raises(ValueError, match="x must be torch.float32 \\[M, 8\\]"):
            call(bad)
