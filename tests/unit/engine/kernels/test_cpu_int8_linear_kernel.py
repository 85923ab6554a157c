"""engine.kernels.cpu_int8_linear: the C kernel against its reference, F.linear on the dequantised
weight, on every path of the kernel (M of one, two and three or more rows; channels in whole and
partial tiles of 4; K a multiple of 8 or not), and its argument checks; the packed VNNI path's
layout and checks (its results: tests/unit/engine/model/test_int8_linear.py); the W8A8 kernel
(8-bit activations, VPDPBUSD) against the float64 GEMM of its rounded activations, and its
rounding against the torch reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.cpu_int8_linear import (
    A8_MAX_K,
    a8_available,
    bind_int8_linear_a8,
    bind_int8_linear_packed,
    int8_linear_cpu,
    int8_linear_packed_cpu,
    load_kernel,
    pack_weight,
    packed_min_rows,
    packed_path,
    packed_rounds_activations,
    pack_weight_a8,
    quantize_rows_8bit,
    quantize_rows_u8,
    split_rows_u8,
    SPLIT_QMAX,
)
from engine.model.linear import dequantize_int8, quantize_int8

# Float32 sums of K <= 1536 products of magnitude ~1 (outputs ~40), in another order than
# F.linear's: measured max abs difference ~5e-5 (relative ~1e-6, float32's own rounding).
FP32_TOL = dict(atol=2e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def kernel():
    lib = load_kernel()
    if lib is None:
        pytest.skip("no working C compiler here")
    return lib


def make(out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_int8(torch.randn(out_features, in_features, generator=gen))


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (10, 24), (7, 13), (5, 8)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 17])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_kernel_equals_f_linear_on_the_dequantised_weight(kernel, shape, num_tokens, bias):
    qweight, scale = make(*shape, seed=shape[0] + num_tokens)
    x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
    b = torch.randn(shape[0]) if bias else None
    out = int8_linear_cpu(kernel, x, qweight, scale, b)
    assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, dequantize_int8(qweight, scale), b), **FP32_TOL)


def test_a_non_contiguous_input_is_read_as_its_values(kernel):
    qweight, scale = make(16, 32, seed=3)
    x = torch.randn(32, 4).t()  # [4, 32], column-major
    torch.testing.assert_close(int8_linear_cpu(kernel, x, qweight, scale, None),
                               F.linear(x, dequantize_int8(qweight, scale)), **FP32_TOL)


def test_bad_arguments_are_refused_before_the_c_code_reads_them(kernel):
    qweight, scale = make(16, 32, seed=4)
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="float32 x, scale and bias with an int8 weight"):
        int8_linear_cpu(kernel, x.double(), qweight, scale, None)
    with pytest.raises(ValueError, match="float32 x, scale and bias with an int8 weight"):
        int8_linear_cpu(kernel, x, qweight.float(), scale, None)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear_cpu(kernel, torch.randn(2, 31), qweight, scale, None)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear_cpu(kernel, x, qweight, scale[:15], None)
    with pytest.raises(ValueError, match="do not fit"):
        int8_linear_cpu(kernel, x, qweight, scale, torch.zeros(15))
    with pytest.raises(ValueError, match="contiguous"):
        int8_linear_cpu(kernel, x, torch.zeros(32, 16, dtype=torch.int8).t(), scale, None)


# --- the packed VNNI path (AVX512-VNNI builds) ------------------------------------------------


def test_packed_path_panels_and_argument_checks(kernel):
    if not packed_path(kernel):
        with pytest.raises(ValueError, match="no packed int8 path"):
            pack_weight(kernel, torch.zeros(4, 4, dtype=torch.int8))
        return
    qweight, scale = make(37, 17, seed=3)
    width = kernel.int8_linear_panel_width()
    packed = pack_weight(kernel, qweight)
    panels = -(-37 // width)
    if packed_rounds_activations(kernel):  # VNNI: k pairs side by side
        assert packed.shape == (panels, 9, width, 2) and packed_min_rows(kernel) == 1
        # Panel 0, pair 8 (k = 16 and the pad k = 17), channel 5: w[5, 16] then a zero.
        assert packed[0, 8, 5].tolist() == [qweight[5, 16].item(), 0]
        assert packed[1, 0, 37 - width - 1].tolist() == qweight[36, :2].tolist()
    else:  # AVX2: one k per row of a panel
        assert packed.shape == (panels, 17, width, 1) and packed_min_rows(kernel) == 3
        assert packed[0, 16, 5, 0].item() == qweight[5, 16].item()
        assert packed[panels - 1, :, 36 - (panels - 1) * width, 0].tolist() == qweight[36].tolist()
    assert packed[panels - 1, :, 37 - (panels - 1) * width:].eq(0).all()  # zeros past N
    with pytest.raises(ValueError, match="a contiguous 2-D int8 CPU weight only"):
        pack_weight(kernel, qweight.float())
    x = torch.randn(3, 17)
    with pytest.raises(ValueError, match="do not fit a \\[37, K\\] weight"):
        int8_linear_packed_cpu(kernel, x, packed, 37, scale[:36], None)
    with pytest.raises(ValueError, match="do not fit a \\[70, K\\] weight"):  # 3 panels, not 2
        int8_linear_packed_cpu(kernel, x, packed, 70, torch.ones(70), None)
    with pytest.raises(ValueError, match="float32 x, scale and bias with packed int8 panels only"):
        int8_linear_packed_cpu(kernel, x.double(), packed, 37, scale, None)


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 17), (16, 8)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_float32_packed_path_equals_f_linear_on_the_dequantised_weight(kernel, shape):
    """The AVX2 packed path (no VNNI): float32 products and sums like int8_linear_cpu's, at every
    row-block split from its first row count on (3..6 rows in one block, 16 = 6 + 5 + 5, 17) and a
    ragged last panel; the bias and a zero row."""
    if not packed_path(kernel) or packed_rounds_activations(kernel):
        pytest.skip("no float32 packed path on this build (VNNI rounds x to int16, tested in test_int8_linear)")
    qweight, scale = make(*shape, seed=shape[0])
    packed = pack_weight(kernel, qweight)
    bias = torch.randn(shape[0])
    for num_tokens in (3, 4, 5, 6, 7, 12, 16, 17):
        x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
        x[1] = 0.0
        out = int8_linear_packed_cpu(kernel, x, packed, shape[0], scale, bias)
        torch.testing.assert_close(out, F.linear(x, dequantize_int8(qweight, scale), bias), **FP32_TOL)
        torch.testing.assert_close(out[1], bias)
        no_bias = int8_linear_packed_cpu(kernel, x, packed, shape[0], scale, None)
        torch.testing.assert_close(no_bias, F.linear(x, dequantize_int8(qweight, scale)), **FP32_TOL)


def test_split_rows_u8_by_hand(kernel):
    """Each row on its own scale max|x| / 32639 (zero point 128 in both bytes, high bytes first),
    values rounded to nearest even, then split into 256 hi + lo with hi rounded half up."""
    x = torch.tensor([[32639.0, -32639.0, 128.0, -128.5, 0.5, 383.0], [0.0] * 6])
    q, s = split_rows_u8(kernel, x)
    assert q.shape == (4, 6) and q.dtype == torch.uint8 and s.tolist() == [1.0, 0.0]
    # 32639 = 256 * 127 + 127; 128 = 256 * 1 - 128 (half up); -128.5 -> -128 (to even) = 256 * 0 - 128;
    # 0.5 -> 0; 383 = 256 * 1 + 127.
    assert (q[0].int() - 128).tolist() == [127, -127, 1, 0, 0, 1]  # the high bytes of row 0
    assert (q[2].int() - 128).tolist() == [127, -127, -128, -128, 0, 127]  # its low bytes
    assert q[1].tolist() == [128] * 6 and q[3].tolist() == [128] * 6  # the zero row


@pytest.mark.parametrize("shape", [(1, 576), (16, 1536), (300, 576), (3, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_split_rows_u8_round_trip_within_half_a_step(kernel, shape):
    """Every value within s[m] / 2 (and float32's rounding) of (256 (hi - 128) + (lo - 128)) s[m], the bytes in range, each
    row's largest magnitude at +-32639, on rows of very different scales; 300 x 576 takes the
    threaded path, 3 x 17 the scalar tail."""
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None]
    q, s = split_rows_u8(kernel, x)
    m = shape[0]
    torch.testing.assert_close(s, x.abs().amax(1) / SPLIT_QMAX)
    hi, lo = q[:m].long() - 128, q[m:].long() - 128
    assert hi.abs().max() <= 127 and lo.min() >= -128 and lo.max() <= 127
    v = 256 * hi + lo
    # Half a step, plus float32's rounding of x / s (2^-24 relative of up to 32639: 0.002 of a step).
    assert ((v.double() * s[:, None].double() - x.double()).abs() <= s[:, None].double() * (0.5 + 4e-3)).all()
    assert v.abs().amax(1).tolist() == [SPLIT_QMAX] * m


def test_split_rows_u8_refuses_bad_input(kernel):
    with pytest.raises(ValueError, match="2-D float32 CPU tensor"):
        split_rows_u8(kernel, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D float32 CPU tensor"):
        split_rows_u8(kernel, torch.zeros(6))


def test_a_bound_packed_linear_checks_its_panels_once_and_each_x(kernel):
    """bind_int8_linear_packed: panels, scale and bias are checked when bound; every call then
    checks x alone and equals the unbound call bit for bit."""
    if not packed_path(kernel):
        pytest.skip("no packed int8 path on this build")
    qweight, scale = make(37, 17, seed=5)
    packed, bias = pack_weight(kernel, qweight), torch.randn(37)
    with pytest.raises(ValueError, match="do not fit a \\[37, K\\] weight"):
        bind_int8_linear_packed(kernel, packed, 17, 37, scale[:36], bias)
    with pytest.raises(ValueError, match="do not fit a \\[37, K\\] weight"):
        bind_int8_linear_packed(kernel, packed, 40, 37, scale, bias)  # K past the panels'
    call = bind_int8_linear_packed(kernel, packed, 17, 37, scale, bias)
    x = torch.randn(4, 17)
    assert torch.equal(call(x), int8_linear_packed_cpu(kernel, x, packed, 37, scale, bias))
    for bad in (torch.randn(4, 16), x.double(), torch.randn(17)):
        with pytest.raises(ValueError, match="x must be float32 \\[M, 17\\]"):
            call(bad)



@pytest.fixture(scope="module")
def a8_kernel(kernel):
    if not a8_available(kernel):
        pytest.skip("no W8A8 path on this build (the CPU lacks AVX512-VNNI)")
    return kernel


def test_quantize_rows_8bit_by_hand():
    """Each row on its own scale max|x| / 127, rounded to nearest even; a zero row stays zero."""
    x = torch.tensor([[127.0, -127.0, 2.5, -3.5, 0.49, 64.0], [0.0] * 6, [254.0, 1.0, 3.0, -1.0, 0.0, 0.0]])
    assert quantize_rows_8bit(x).tolist() == [[127.0, -127.0, 2.0, -4.0, 0.0, 64.0], [0.0] * 6,
                                              [254.0, 0.0, 4.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize("shape", [(1, 576), (16, 1536), (300, 576), (3, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_quantize_rows_u8_is_the_torch_rounding(kernel, shape):
    """The C rounding (the W8A8 kernels') gives the torch reference's values bit for bit, on rows
    of very different scales; 300 x 576 takes the threaded path, 3 x 17 the scalar tail."""
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 3, shape[0])[:, None]
    q, s = quantize_rows_u8(kernel, x)
    assert q.dtype == torch.uint8 and s.shape == (shape[0],)
    assert torch.equal((q.float() - 128) * s[:, None], quantize_rows_8bit(x))
    assert ((q.int() - 128).abs().amax(1) == 127).all()
    zero_q, zero_s = quantize_rows_u8(kernel, torch.zeros(2, 5))
    assert zero_q.tolist() == [[128] * 5] * 2 and zero_s.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("shape", [(960, 576), (3072, 576), (576, 1536), (37, 17), (5, 8), (33, 6)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 8, 9, 17, 100])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_w8a8_kernel_equals_the_gemm_of_its_rounded_activations(a8_kernel, shape, num_tokens, bias):
    """Every row block size (1-8 rows, unrolled per count), whole and partial panels of 32
    channels, K a multiple of 4 or not: the int32 sums are exact, so the output is the float64
    GEMM of the 8-bit rows with the dequantised weight up to float32's rounding of the scaling."""
    n, k = shape
    qweight, scale = make(n, k, seed=n + num_tokens)
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, generator=gen) * torch.logspace(-2, 2, num_tokens)[:, None]
    b = torch.randn(n, generator=gen) if bias else None
    out = bind_int8_linear_a8(a8_kernel, pack_weight_a8(a8_kernel, qweight), k, n, scale, b)(x)
    assert out.shape == (num_tokens, n) and out.dtype == torch.float32
    ref = F.linear(quantize_rows_8bit(x).double(), dequantize_int8(qweight, scale).double(),
                   None if b is None else b.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-6)


def test_w8a8_kernel_zero_and_nonfinite_rows(a8_kernel):
    """A zero row gives the bias; a row holding a NaN or an infinity gives NaN outputs, and the
    other rows of its batch are untouched."""
    qweight, scale = make(40, 24, seed=3)
    bias = torch.randn(40)
    call = bind_int8_linear_a8(a8_kernel, pack_weight_a8(a8_kernel, qweight), 24, 40, scale, bias)
    x = torch.randn(4, 24)
    x[1] = 0.0
    x[2, 5] = float("nan")
    x[3, 7] = float("inf")
    out = call(x)
    assert torch.equal(out[1], bias)
    assert out[2].isnan().all() and out[3].isnan().all()
    assert torch.equal(out[0], call(x[:1])[0])


def test_w8a8_pack_layout_and_checks(a8_kernel):
    """The packed bytes: panels [ceil(N / 32)][ceil(K / 4)][32][4] (zeros past N and K), then
    128 colsum per channel as int32 (zeros past N); the binder refuses what does not fit."""
    qweight, scale = make(37, 6, seed=7)
    packed = pack_weight_a8(a8_kernel, qweight)
    panels = packed[:2 * 2 * 32 * 4].view(2, 2, 32, 4)
    expected = torch.zeros(2, 2, 32, 4, dtype=torch.int8)
    w = torch.zeros(64, 8, dtype=torch.int8)
    w[:37, :6] = qweight
    expected[:] = w.view(2, 32, 2, 4).permute(0, 2, 1, 3)
    assert torch.equal(panels, expected)
    corr = packed[2 * 2 * 32 * 4:].view(torch.int32)
    assert corr.tolist() == (128 * qweight.int().sum(1)).tolist() + [0] * 27
    with pytest.raises(ValueError, match="do not fit a \\[37, 6\\] weight"):
        bind_int8_linear_a8(a8_kernel, packed, 6, 37, scale[:36], None)
    with pytest.raises(ValueError, match="do not fit a \\[37, 10\\] weight"):
        bind_int8_linear_a8(a8_kernel, packed, 10, 37, scale, None)  # K past the packed quads
    with pytest.raises(ValueError, match="contiguous 2-D int8 CPU weight"):
        pack_weight_a8(a8_kernel, qweight.float())
    with pytest.raises(ValueError, match=f"K <= {A8_MAX_K}"):
        pack_weight_a8(a8_kernel, torch.zeros(1, A8_MAX_K + 1, dtype=torch.int8))
    call = bind_int8_linear_a8(a8_kernel, packed, 6, 37, scale, None)
    for bad in (torch.randn(4, 5), torch.randn(4, 6).double(), torch.randn(6)):
        with pytest.raises(ValueError, match="x must be float32 \\[M, 6\\]"):
            call(bad)
