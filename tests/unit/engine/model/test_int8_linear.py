"""--quantization int8: per-channel quantisation, every int8 backend against the float32 layer
within the error bound the quantisation allows, the chooser on int8 layers, the loader, and the
configuration's refusals."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.model import linear_chooser
from engine.kernels.cpu_int8_linear import load_kernel as load_int8_kernel
from engine.kernels.cpu_int8_linear import SPLIT_QMAX, packed_rounds_activations, quantize_rows_8bit
from engine.model.linear import BACKENDS, INT8_BACKENDS, Linear, backend_supports, dequantize_int8, quantize_int8
from engine.model.linear_chooser import LinearSetup, choose_plan, plan_linears, shape_key
from engine.model.loader import W8A8_LAYERS, load_model
from tests.factories import engine_logits
from tests.unit.engine.model.test_loader import MAX_POSITIONS, PROMPT, save_tiny_llama

# SmolLM2-135M's fused projections and LM head, [out, in]: qkv, o, gate_up, down, LM head.
REAL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
available = [b for b in INT8_BACKENDS if backend_supports(b, torch.empty(1, 1, dtype=torch.int8))]
# Whether int8_cpu runs the packed VNNI path here (activations quantised to int16 per row; the
# AVX2 packed path computes in float32 like the unpacked kernel).
PACKED = "int8_cpu" in available and packed_rounds_activations(load_int8_kernel())
INT8_BACKENDS_INDEX = BACKENDS.index("int8_cpu")


def quantized_linear(out_features: int, in_features: int, bias: bool, seed: int,
                     activation_bits: int = 16) -> tuple[Linear, torch.Tensor]:
    """A quantised layer and the float32 weight it was quantised from."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    layer.weight.data = torch.randn(out_features, in_features, generator=gen)
    if bias:
        layer.bias.data = torch.randn(out_features, generator=gen)
    weight = layer.weight.detach().clone()
    layer.quantize_int8(activation_bits)
    return layer, weight


def error_bound(layer: Linear, x: torch.Tensor, backend: str) -> torch.Tensor:
    """[M, out]: how far the int8 layer's output may be from the float32 layer's.

    Rounding each weight to the nearest multiple of its channel's scale moves it by at most
    scale[n] / 2, so |y_int8 - y_fp32| <= scale[n] / 2 * sum_k |x[m, k]| (the worst case: every
    error of one sign), plus float32's own rounding of the sums (FP32 below). ``int8pack`` also
    rounds x, the scales and the output to bfloat16 (8 significant bits: relative 2^-8 each) and
    sums bfloat16 products: 2^-7 x sum_k |x_k| |w_k| + 2^-8 |y| more.
    """
    half_step = layer.weight_scale / 2
    bound = x.abs().sum(1, keepdim=True) * half_step[None, :] + 2e-4 + 1e-5 * x.abs().sum(1, keepdim=True)
    if backend == "int8pack":
        w = dequantize_int8(layer.qweight, layer.weight_scale)
        bound = bound + 2 ** -7 * (x.abs() @ w.abs().T) + 2 ** -8 * F.linear(x, w, layer.bias).abs()
    if backend == "int8_cpu" and PACKED:
        bound = bound + activation_bound(layer, x)
    if backend == "int8_onednn":
        bound = bound + activation_bound(layer, x, qmax=SPLIT_QMAX)
    return bound


def activation_bound(layer: Linear, x: torch.Tensor, qmax: int | None = None) -> torch.Tensor:
    """[M, out]: the packed (VNNI) int8_cpu path rounds each x value to a multiple of
    ``max|x[m]| / qmax`` (cpu/int8_linear.c; int8_onednn: SPLIT_QMAX), moving it by at most half
    that: ``max|x[m]| / (2 qmax) * sum_k |w[n, k]|`` on the output."""
    k = x.shape[1] + x.shape[1] % 2
    qmax = qmax or min(32767, (2**31 - 1) // (127 * k))
    w = dequantize_int8(layer.qweight, layer.weight_scale)
    return x.abs().amax(1, keepdim=True) / (2 * qmax) * w.abs().sum(1)[None, :]


def test_quantize_int8_per_channel_symmetric():
    weight = torch.tensor([[0.5, -1.0, 0.25, 0.0], [2.0, 1.0, -2.0, 0.7], [0.0, 0.0, 0.0, 0.0]])
    qweight, scale = quantize_int8(weight)
    assert qweight.dtype == torch.int8 and scale.dtype == torch.float32
    torch.testing.assert_close(scale, torch.tensor([1.0 / 127, 2.0 / 127, 1.0]))  # a zero row: scale 1
    assert qweight.tolist() == [[64, -127, 32, 0], [127, 64, -127, 44], [0, 0, 0, 0]]  # 63.5 -> 64, 44.45 -> 44
    error = (dequantize_int8(qweight, scale) - weight).abs()
    assert (error <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("backend", available)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=[f"{o}x{i}" for o, i in REAL_SHAPES])
def test_each_int8_backend_is_within_the_quantisation_bound_of_float32(backend, shape):
    layer, weight = quantized_linear(*shape, bias=True, seed=shape[0])
    layer.set_plan((backend,))
    assert layer.backend_for(5) == backend and layer.weight is None
    for num_tokens in (1, 3, 16):
        x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
        out = layer(x)
        assert out.shape == (num_tokens, shape[0]) and out.dtype == torch.float32
        error = (out - F.linear(x, weight, layer.bias)).abs()
        assert (error <= error_bound(layer, x, backend)).all()
        # The bound is a worst case: the errors, of both signs, mostly cancel. Measured here: the
        # largest error is 0.16 of its bound (int8pack 0.11); a wrong scale or a wrong row is
        # far outside it.
        assert error.max() > 0


@pytest.mark.parametrize("backend", [b for b in available if b not in ("int8pack", "int8_onednn")
                                     and not (b == "int8_cpu" and PACKED)])
def test_exact_int8_backends_equal_the_dequantised_reference(backend):
    """int8_cpu (without the packed path) and int8_dequant compute in float32 what F.linear on
    the dequantised weight does."""
    layer, _ = quantized_linear(960, 576, bias=True, seed=7)
    layer.set_plan((backend,))
    x = torch.randn(6, 576)
    torch.testing.assert_close(layer(x), F.linear(x, dequantize_int8(layer.qweight, layer.weight_scale), layer.bias),
                               atol=2e-4, rtol=1e-5)


@pytest.mark.skipif(not PACKED, reason="no AVX512-VNNI here: int8_cpu widens the weight to float32")
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 17)], ids=["960x576", "576x1536", "37x17"])
def test_packed_int8_cpu_is_within_the_int16_activation_bound_of_the_dequantised_reference(shape):
    """The VNNI path: only the activations' int16 rounding apart from F.linear on the dequantised
    weight, at every M bucket's row-block split (1..8 rows, 16 = 8 + 8, 33 = 7 + 7 + 7 + 6 + 6) and
    a ragged last panel (37 outputs); a zero row gives the bias."""
    layer, _ = quantized_linear(*shape, bias=True, seed=7)
    layer.set_plan(("int8_cpu",))
    assert layer.prepared[INT8_BACKENDS_INDEX] is not None
    for num_tokens in (1, 2, 3, 5, 8, 16, 33):
        x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
        x[0] = 0.0
        want = F.linear(x.double(), dequantize_int8(layer.qweight, layer.weight_scale).double(), layer.bias.double())
        error = (layer(x).double() - want).abs()
        bound = activation_bound(layer, x).double() + 1e-4
        assert (error <= bound).all()
        assert num_tokens == 1 or error[1:].max() > 1e-6  # the int16 rounding is there: not the float32 path
        torch.testing.assert_close(layer(x)[0], layer.bias)


def test_an_unplanned_int8_layer_runs_int8_dequant_and_float_backends_are_refused():
    layer, _ = quantized_linear(32, 48, bias=False, seed=1)
    assert layer.plan is None and layer.backend_for(3) == "torch"  # no plan: the reference below
    x = torch.randn(2, 3, 48)  # any leading shape
    torch.testing.assert_close(layer(x), F.linear(x, dequantize_int8(layer.qweight, layer.weight_scale)))
    with pytest.raises(ValueError, match="'onednn' cannot run a torch.int8 weight"):
        layer.set_plan(("onednn",))
    assert not backend_supports("torch", layer.qweight) and not backend_supports("int8_dequant", torch.empty(1, 1))


def test_quantising_a_non_float32_weight_is_refused():
    layer = Linear(8, 4)
    layer.weight.data = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="int8 quantisation needs a float32 weight, got torch.bfloat16"):
        layer.quantize_int8()


@pytest.mark.parametrize("backend", available)
def test_int8_layer_under_torch_compile(backend):
    torch._dynamo.reset()  # every layer compiled in this file counts towards one code object's recompile limit
    layer, _ = quantized_linear(40, 64, bias=True, seed=2)
    layer.set_plan((backend,))
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for num_tokens in (3, 16, 1):
        x = torch.randn(num_tokens, 64)
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)


# --- W8A8 layers (8-bit activations) ------------------------------------------------------------

W8A8_BACKENDS = [b for b in available if b != "int8pack"]


@pytest.mark.parametrize("backend", W8A8_BACKENDS)
@pytest.mark.parametrize("shape", [(576, 576), (3072, 576), (576, 1536), (37, 17)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_w8a8_backend_is_the_gemm_of_the_8bit_rows(backend, shape):
    """Whichever backend runs a W8A8 layer, its output is the float64 GEMM of the 8-bit rows
    (quantize_rows_8bit) with the dequantised weight, up to float32's rounding of the sums."""
    layer, _ = quantized_linear(*shape, bias=True, seed=shape[0], activation_bits=8)
    layer.set_plan((backend,))
    for num_tokens in (1, 16, 100):
        x = torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens))
        ref = F.linear(quantize_rows_8bit(x).double(), dequantize_int8(layer.qweight, layer.weight_scale).double(),
                       layer.bias.double())
        out = layer(x)
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)


def test_w8a8_layers_refuse_int8pack_and_say_so():
    layer, _ = quantized_linear(40, 64, bias=False, seed=1, activation_bits=8)
    assert not backend_supports("int8pack", layer.qweight, 8) and "w8a8" in repr(layer)
    with pytest.raises(ValueError, match="cannot run a torch.int8 weight on cpu with 8-bit activations"):
        layer.set_plan(("int8pack",))
    with pytest.raises(ValueError, match="activation_bits must be one of \\(16, 8\\), got 4"):
        quantized_linear(40, 64, bias=False, seed=1, activation_bits=4)


def test_forcing_int8pack_on_w8a8_layers_names_them(caplog):
    """--linear-backend int8pack with --quantization int8: the O and gate/up layers (8-bit rows)
    fall back to int8_dequant, and the warning says why."""
    layer, _ = quantized_linear(40, 64, bias=False, seed=1, activation_bits=8)
    with caplog.at_level(logging.WARNING, logger=linear_chooser.__name__):
        plan = choose_plan(torch.nn.Sequential(layer), LinearSetup("int8pack", max_num_seqs=1, max_num_batched_tokens=1))
    assert plan.choices == {"int8a8:40x64": ["int8_dequant"]}
    assert "linear backend int8pack cannot run 1 of 1 weight shapes here (int8pack does not run the layers with " \
           "8-bit activations: --quantization int8's O and gate/up)" in caplog.text


@pytest.mark.parametrize("backend", W8A8_BACKENDS)
def test_w8a8_layer_under_torch_compile(backend):
    torch._dynamo.reset()  # every layer compiled in this file counts towards one code object's recompile limit
    layer, _ = quantized_linear(40, 64, bias=True, seed=2, activation_bits=8)
    layer.set_plan((backend,))
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for num_tokens in (3, 16, 1):
        x = torch.randn(num_tokens, 64)
        torch.testing.assert_close(compiled(x), layer(x), atol=1e-5, rtol=1e-5)


def test_chooser_keys_w8a8_layers_apart(tmp_path, monkeypatch):
    """A W8A8 layer and an int8 one of the same shape are timed and planned apart (other kernels),
    int8pack never among the W8A8 layer's candidates."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    monkeypatch.setattr(linear_chooser.OtherCpuUse, "cores", lambda self: 0.0)
    a16, _ = quantized_linear(48, 64, bias=False, seed=3)
    a8, _ = quantized_linear(48, 64, bias=False, seed=4, activation_bits=8)
    plan = plan_linears(torch.nn.Sequential(a16, a8), LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=2))
    assert set(plan.choices) == {"int8:48x64", "int8a8:48x64"}
    assert set(plan.timings_ms["int8a8:48x64"]) == set(W8A8_BACKENDS)
    assert [a8.backend_for(m) for m in (1, 2)] == plan.choices["int8a8:48x64"]


# --- the chooser -------------------------------------------------------------------------------


def test_chooser_measures_only_int8_backends_on_int8_layers(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    monkeypatch.setattr(linear_chooser.OtherCpuUse, "cores", lambda self: 0.0)
    layer, _ = quantized_linear(48, 64, bias=False, seed=3)
    model = torch.nn.Sequential(layer)
    assert shape_key(layer.gemm_weight) == "int8:48x64"
    plan = plan_linears(model, LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=2))
    assert set(plan.timings_ms["int8:48x64"]) == set(available)
    assert set(plan.choices["int8:48x64"]) <= set(available) and len(plan.choices["int8:48x64"]) == 2
    assert [layer.backend_for(m) for m in (1, 2)] == plan.choices["int8:48x64"]


def test_a_forced_float_backend_leaves_int8_layers_on_int8_dequant_with_a_warning(caplog):
    layer, _ = quantized_linear(48, 64, bias=False, seed=4)
    with caplog.at_level(logging.WARNING, logger=linear_chooser.__name__):
        plan = choose_plan(torch.nn.Sequential(layer), LinearSetup("onednn", max_num_seqs=1, max_num_batched_tokens=1))
    assert plan.choices == {"int8:48x64": ["int8_dequant"]}
    assert "linear backend onednn cannot run 1 of 1 weight shapes here (a float backend cannot run " \
           "--quantization int8 / w8a16 layers); instead: int8:48x64 torch.int8 on cpu through int8_dequant" in caplog.text


def test_a_forced_int8_backend_on_a_float_model_says_it_runs_torch(caplog):
    """A user who forces an int8 backend without --quantization int8 is told, not silently given
    F.linear."""
    layer = Linear(64, 48)
    layer.weight.data = torch.randn(48, 64)
    with caplog.at_level(logging.WARNING, logger=linear_chooser.__name__):
        plan = choose_plan(torch.nn.Sequential(layer), LinearSetup("int8_cpu", max_num_seqs=1, max_num_batched_tokens=1))
    assert plan.choices == {"48x64": ["torch"]}
    assert "linear backend int8_cpu cannot run 1 of 1 weight shapes here (an int8 backend runs --quantization " \
           "int8 / w8a16 layers only); instead: 48x64 torch.float32 on cpu through torch" in caplog.text


# --- the loader and the configuration ----------------------------------------------------------


def test_loader_quantises_every_linear_layer_and_keeps_the_embedding_float(tmp_path):
    """--quantization w8a16 on a tiny tied-head model: every Linear (the LM head too) becomes int8, the embedding stays
    float32, and the logits equal those of the float32 model given the dequantised weights."""
    save_tiny_llama(tmp_path, tie_word_embeddings=True, attention_bias=True)
    dequantised = load_model(tmp_path, "float32", "cpu", MAX_POSITIONS, linear=None)
    for layer in [m for m in dequantised.modules() if isinstance(m, Linear)]:
        layer.weight = torch.nn.Parameter(dequantize_int8(*quantize_int8(layer.weight)), requires_grad=False)
    model = load_model(tmp_path, "float32", "cpu", MAX_POSITIONS, LinearSetup("int8_cpu"), quantization="w8a16")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 2 * 4 + 1 and all(m.qweight is not None and m.weight is None for m in linears)
    assert model.model.embed_tokens.weight.dtype == torch.float32
    expected = "int8_cpu" if "int8_cpu" in available else "int8_dequant"
    assert {m.backend_for(n) for m in linears for n in (1, 16)} == {expected}
    backend = CpuAttentionBackend()
    # Logits of magnitude ~20 (initializer_range 0.5), float32 sums in other orders: as in test_loader.
    # The packed VNNI path also rounds each layer's input rows to int16 (relative 1/(2 qmax) of
    # the row's largest value, ~2e-5 here, through 2 layers and the head): measured 0.013 at most.
    atol = 3e-2 if expected == "int8_cpu" and PACKED else 1e-4
    torch.testing.assert_close(engine_logits(model, PROMPT, backend), engine_logits(dequantised, PROMPT, backend),
                               atol=atol, rtol=1e-5)


def test_loader_int8_rounds_the_attention_output_and_gate_up_inputs(tmp_path):
    """--quantization int8: O and gate/up round their inputs to 8 bits per row, QKV, down and the
    LM head do not; through int8_dequant the logits equal those of the float32 model given the
    dequantised weights and the same rounding of those three layers' inputs. (Through the VNNI
    kernels the QKV rows' int16 rounding moves some 8-bit roundings of the next layer's input by a
    step: the kernels are checked one by one above.)"""
    save_tiny_llama(tmp_path, tie_word_embeddings=True, attention_bias=True)
    reference_model = load_model(tmp_path, "float32", "cpu", MAX_POSITIONS, linear=None)
    for name, layer in reference_model.named_modules():
        if isinstance(layer, Linear):
            layer.weight = torch.nn.Parameter(dequantize_int8(*quantize_int8(layer.weight)), requires_grad=False)
            if name.endswith(W8A8_LAYERS):
                layer.register_forward_pre_hook(lambda module, args: (quantize_rows_8bit(args[0]),))
    model = load_model(tmp_path, "float32", "cpu", MAX_POSITIONS, LinearSetup("int8_dequant"), quantization="int8")
    bits = {name: m.activation_bits for name, m in model.named_modules() if isinstance(m, Linear)}
    assert bits == {**{f"model.layers.{i}.{n}": 8 if n in W8A8_LAYERS else 16 for i in range(2)
                       for n in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")},
                    "lm_head": 16}
    backend = CpuAttentionBackend()
    torch.testing.assert_close(engine_logits(model, PROMPT, backend), engine_logits(reference_model, PROMPT, backend),
                               atol=1e-4, rtol=1e-5)
    auto = load_model(tmp_path, "float32", "cpu", MAX_POSITIONS, LinearSetup("auto", use_cache=False),
                      quantization="int8")
    assert "int8pack" not in {m.backend_for(n) for m in auto.modules() if isinstance(m, Linear)
                              and m.activation_bits == 8 for n in (1, 16, 64)}


def test_loader_refuses_int8_with_half_precision(tmp_path):
    with pytest.raises(ValueError, match="quantization must be 'none', 'fp8', or 'int8' or 'w8a16' with dtype float32"):
        load_model(tmp_path, "bfloat16", "cpu", MAX_POSITIONS, quantization="int8")


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="int4"), r"quantization must be one of \('none', 'int8', 'w8a16', 'fp8'\), got 'int4'"),
    (dict(quantization="fp8"), r"quantization 'fp8' runs on CUDA GPUs with float8 GEMMs \(compute capability 8.9 "
                               r"or later\), not on device 'cpu': use 'int8' or 'w8a16' there"),
    (dict(quantization="int8", dtype="bfloat16"), r"quantization 'int8' takes float32 activations: it needs "
                                                  r"dtype 'float32', got 'bfloat16'"),
    (dict(quantization="w8a16", dtype="float16"), r"quantization 'w8a16' takes float32 activations"),
])
def test_config_refuses_bad_quantization_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_workers_and_tandem_up_take_the_flag_and_refuse_unknown_values():
    from click.testing import CliRunner

    from decode_worker.__main__ import main as decode_main
    from tandem_cli.up import up

    for command in (decode_main, up):
        params = {p.name: p for p in command.params}
        assert params["quantization"].default == "none"
        result = CliRunner().invoke(command, ["--quantization", "int4"])
        assert result.exit_code == 2 and "Invalid value for '--quantization'" in result.output
        assert "'none', 'int8', 'w8a16', 'fp8'" in result.output or "none, int8, w8a16, fp8" in result.output


@pytest.mark.skipif("int8_onednn" not in available, reason="no oneDNN u8 x s8 inner product on this CPU (AMX or VNNI)")
def test_int8_onednn_scales_each_row_on_its_own():
    """Per-row activation scales: a row's output does not depend on the rows beside it (a
    per-tensor scale would let one large row coarsen every other row of the batch), a zero row
    gives the bias, and the 16-bit split activations stay within their bound of float32."""
    layer, weight = quantized_linear(960, 576, bias=True, seed=3)
    layer.set_plan(("int8_onednn",))
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(5))
    x[2] *= 1000.0
    x[0] = 0.0
    out = layer(x)
    for i in (1, 3, 15):
        torch.testing.assert_close(out[i], layer(x[i:i + 1])[0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(out[0], layer.bias)
    error = (out - F.linear(x, weight, layer.bias)).abs()
    assert (error <= error_bound(layer, x, "int8_onednn")).all()


@pytest.mark.parametrize("backend", [b for b in ("int8_cpu", "int8_onednn") if b in available])
def test_rows_quantised_on_the_fly_keep_nan_and_infinity_and_tiny_rows(backend):
    """Backends that quantise each activation row (int8_cpu's VNNI path, int8_onednn): a row
    holding a NaN or an infinity gives NaN outputs (the float GEMM gives NaN or +-inf there), never
    finite numbers; a row of magnitude ~1e-36 (its scale's reciprocal past float32's range) gives
    what float32 gives within 1e-30, not garbage; the other rows are untouched."""
    if backend == "int8_cpu" and not PACKED:
        pytest.skip("int8_cpu computes in float32 here: nothing is quantised")
    layer, _ = quantized_linear(40, 37, bias=False, seed=9)
    layer.set_plan((backend,))
    x = torch.randn(4, 37, generator=torch.Generator().manual_seed(2))
    x[0, 20], x[1, 3], x[2] = float("nan"), float("inf"), x[2] * 1e-36
    out = layer(x)
    assert out[0].isnan().all() and out[1].isnan().all()
    reference = F.linear(x, dequantize_int8(layer.qweight, layer.weight_scale))
    assert (out[2] - reference[2]).abs().max() < 1e-30
    torch.testing.assert_close(out[3], reference[3], atol=1e-3, rtol=1e-3)
