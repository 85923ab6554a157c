"""engine.model.linear: every GEMM backend against F.linear (toy and the real model's shapes),
per-M-bucket dispatch, torch.compile; engine.model.linear_chooser: forced plans, a cheap
measurement, the per-machine cache."""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch
import torch.nn.functional as F

from engine.model import linear_chooser
from engine.model.linear import BACKENDS, Linear, backend_supports, m_bucket
from engine.model.linear_chooser import LinearPlan, LinearSetup, choose_plan, fastest, plan_linears

# The backends sum the K products in other orders than F.linear: for K <= 1536 and inputs and
# weights ~N(0, 1) (outputs of order sqrt(K) ~ 40) the max abs difference measured was ~1e-4,
# i.e. ~3e-6 relative; float32's own rounding of such sums is of that order.
FP32_TOL = dict(atol=2e-4, rtol=1e-5)
# bfloat16 outputs: 8 mantissa bits, so 2^-8 relative; oneDNN accumulates in float32 as F.linear.
BF16_TOL = dict(atol=0.25, rtol=1.6e-2)
IN, OUT = 96, 80
# SmolLM2-135M's fused projections and LM head, [out, in]: qkv, o, gate_up, down, LM head.
REAL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]

available = [b for b in BACKENDS if backend_supports(b, torch.empty(1, 1))]


def make_linear(bias: bool, dtype=torch.float32, seed: int = 0, out: int = OUT, inp: int = IN) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(inp, out, bias=bias)
    layer.weight.data = torch.randn(out, inp, generator=gen).to(dtype)
    if bias:
        layer.bias.data = torch.randn(out, generator=gen).to(dtype)
    return layer


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 2, 3, 4, 5, 8, 9, 16, 17, 2048)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 11]


@pytest.mark.parametrize("backend", available)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16, 100])
def test_each_backend_equals_f_linear(backend, num_tokens, bias):
    layer = make_linear(bias, seed=num_tokens)
    layer.set_plan((backend,))
    assert layer.backend_for(num_tokens) == backend
    x = torch.randn(num_tokens, IN, generator=torch.Generator().manual_seed(1))
    out = layer(x)
    assert out.shape == (num_tokens, OUT) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), **FP32_TOL)


@pytest.mark.parametrize("backend", available)
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=[f"{o}x{i}" for o, i in REAL_SHAPES])
def test_each_backend_on_the_real_model_shapes(backend, shape):
    out_features, in_features = shape
    layer = make_linear(bias=False, out=out_features, inp=in_features, seed=out_features)
    layer.set_plan((backend,))
    for num_tokens in (1, 3, 16, 64):
        x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens))
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=5e-4, rtol=1e-5)


@pytest.mark.skipif(not backend_supports("onednn", torch.empty(1, 1, dtype=torch.bfloat16)),
                    reason="oneDNN runs no bfloat16 here (no AVX-512 / AVX-NE-CONVERT, or no oneDNN)")
@pytest.mark.parametrize("num_tokens", [1, 5, 32])
def test_onednn_bfloat16_equals_f_linear_bfloat16(num_tokens):
    layer = make_linear(bias=True, dtype=torch.bfloat16, out=3072, inp=576)
    layer.set_plan(("onednn",))
    x = torch.randn(num_tokens, 576).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x.float(), layer.weight.float(), layer.bias.float()), **BF16_TOL)


@pytest.mark.skipif(not backend_supports("fp32_cpu", torch.empty(1, 1, dtype=torch.bfloat16)),
                    reason="no working C compiler here")
@pytest.mark.parametrize("shape", REAL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_fp32_cpu_bfloat16_equals_f_linear_bfloat16(shape, num_tokens):
    """Tandem's kernel on a bfloat16 layer of the real model's shapes (any CPU with AVX2)."""
    layer = make_linear(bias=False, dtype=torch.bfloat16, out=shape[0], inp=shape[1])
    layer.set_plan(("fp32_cpu",))
    x = torch.randn(num_tokens, shape[1]).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and layer.backend_for(num_tokens) == "fp32_cpu"
    torch.testing.assert_close(out.float(), F.linear(x.float(), layer.weight.float()), **BF16_TOL)


def test_plan_dispatches_by_m_bucket():
    """Bucket 0 (M=1) -> torch, bucket 1 (M=2) -> onednn, buckets 2.. (M>=3, past the plan's end
    too) -> mkl; each result equals F.linear."""
    if not {"onednn", "mkl"} <= set(available):
        pytest.skip("needs oneDNN and MKL")
    layer = make_linear(bias=True)
    layer.set_plan(("torch", "onednn", "mkl"))
    assert [layer.backend_for(m) for m in (1, 2, 3, 4, 500)] == ["torch", "onednn", "mkl", "mkl", "mkl"]
    assert layer.prepared[BACKENDS.index("torch")] is None
    assert layer.prepared[BACKENDS.index("onednn")] is not None and layer.prepared[BACKENDS.index("mkl")] is not None
    for m in (1, 2, 7):
        x = torch.randn(m, IN)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **FP32_TOL)


def test_unplanned_and_non_2d_inputs_are_f_linear_exactly():
    layer = make_linear(bias=True)
    x = torch.randn(2, 5, IN)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.set_plan((available[0],))
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    layer.clear_plan()
    assert layer.plan is None and layer.backend_for(4) == "torch"


def test_a_backend_that_cannot_run_the_dtype_is_refused():
    layer = make_linear(bias=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'mkl' cannot run a torch.bfloat16 weight"):
        layer.set_plan(("mkl",))
    with pytest.raises(ValueError, match="'cuda' cannot run"):
        layer.set_plan(("cuda",))
    assert layer.plan is None


def test_tied_weight_is_prepared_from_the_given_tensor():
    """set_plan(plan, weight) prepares the given tensor (the tied LM head passes the embedding's)."""
    layer = make_linear(bias=False)
    other = torch.randn(OUT, IN)
    layer.set_plan((available[0],), other)
    x = torch.randn(4, IN)
    torch.testing.assert_close(layer(x), F.linear(x, other), **FP32_TOL)


@pytest.mark.parametrize("backend", available)
def test_planned_linear_under_torch_compile(backend):
    """Under torch.compile a planned layer is the opaque custom op tandem::planned_linear; dynamic
    shapes, so one graph serves every number of tokens."""
    layer = make_linear(bias=True)
    layer.set_plan((backend, backend))
    graphs = torch._dynamo.explain(layer)(torch.randn(3, IN)).graphs
    assert "torch.ops.tandem.planned_linear" in graphs[0].code
    compiled = torch.compile(layer, dynamic=True, fullgraph=True)
    for num_tokens in (3, 16, 5, 1):
        x = torch.randn(num_tokens, IN)
        torch.testing.assert_close(compiled(x), F.linear(x, layer.weight, layer.bias), **FP32_TOL)


# --- the chooser -------------------------------------------------------------------------------


def test_fastest_breaks_ties_by_backend_order():
    assert fastest({"onednn": 1.09, "mkl": 1.0, "torch": 2.0}) == "onednn"  # within 10 %: a tie
    assert fastest({"onednn": 1.2, "mkl": 1.0, "torch": 1.05}) == "mkl"
    assert fastest({"torch": 0.5, "mkl": 1.0}) == "torch"


def test_schedules_of_one_kernel_compete_on_time_alone():
    """fp32_stream gives fp32_cpu's result bit for bit: the faster of the two is kept however
    small its lead, and the pair stands at fp32_cpu's place in the order against the others."""
    assert fastest({"fp32_cpu": 1.0, "fp32_stream": 0.97}) == "fp32_stream"
    assert fastest({"fp32_cpu": 0.97, "fp32_stream": 1.0}) == "fp32_cpu"
    assert fastest({"onednn": 1.05, "fp32_cpu": 1.0, "fp32_stream": 0.97}) == "onednn"  # a tie with onednn
    assert fastest({"onednn": 1.2, "fp32_cpu": 1.0, "fp32_stream": 0.97}) == "fp32_stream"
    assert fastest({"torch": 1.0, "fp32_stream": 0.5}) == "fp32_stream"  # without fp32_cpu timed


def test_decode_buckets_kept_on_the_c_kernels_where_the_layer_ties():
    """A decode bucket moves to the C kernels when the layer's GEMMs there are, together, within
    10 % of the chosen ones (then the pass runs as one C call); past it, or outside the decode
    buckets, the plan stays as measured."""
    timings = {  # per shape, per backend: ms at buckets 0, 1, 2
        "960x64": {"onednn": [1.0, 1.0, 1.0], "fp32_cpu": [0.9, 1.0, 2.0], "fp32_stream": [0.95, 0.9, 2.0]},
        "64x960": {"onednn": [1.0, 1.0, 1.0], "fp32_cpu": [1.05, 1.5, 2.0], "fp32_stream": [1.2, 1.6, 2.0]},
    }
    choices = {"960x64": ["fp32_cpu", "onednn", "onednn"], "64x960": ["onednn", "onednn", "onednn"],
               "lm": ["onednn"] * 3}
    plan = LinearPlan({k: list(v) for k, v in choices.items()}, timings)
    # bucket 0: 0.9 + 1.05 against 0.9 + 1.0 (+2.6 %): moved; bucket 1: 0.9 + 1.5 against 2.0
    # (+20 %): kept; bucket 2 is past the decode buckets
    assert linear_chooser.keep_layers_on_c_kernels(plan, ["960x64", "64x960"], num_buckets=2) == [0]
    assert plan.choices == {"960x64": ["fp32_cpu", "onednn", "onednn"], "64x960": ["fp32_cpu", "onednn", "onednn"],
                            "lm": ["onednn"] * 3}
    # no C timing for a shape (a forced or an old cached plan): nothing moves
    bare = LinearPlan({k: list(v) for k, v in choices.items()}, {"960x64": timings["960x64"]})
    assert linear_chooser.keep_layers_on_c_kernels(bare, ["960x64", "64x960"], num_buckets=2) == []


@pytest.mark.skipif(not backend_supports("fp32_stream", torch.empty(1, 1)), reason="no working C compiler here")
def test_a_plan_naming_both_schedules_packs_the_weight_once():
    layer = make_linear(bias=True)
    layer.set_plan(("fp32_stream", "fp32_cpu", "fp32_stream"))
    packed = layer.prepared[BACKENDS.index("fp32_cpu")]
    assert packed is not None and layer.prepared[BACKENDS.index("fp32_stream")] is packed
    assert [layer.backend_for(m) for m in (1, 2, 3, 16)] == ["fp32_stream", "fp32_cpu", "fp32_stream", "fp32_stream"]
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(2))
    assert torch.equal(layer(x[:2]), layer(x)[:2])  # bucket 1 (fp32_cpu) and 2 (fp32_stream) agree bit for bit
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), **FP32_TOL)
    bf16 = make_linear(bias=False, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'fp32_stream' cannot run a torch.bfloat16 weight"):
        bf16.set_plan(("fp32_stream",))


def test_forced_backend_plan_covers_every_bucket():
    model = torch.nn.Sequential(make_linear(True), make_linear(False, seed=1, out=32))
    plan = choose_plan(model, LinearSetup(available[0], max_num_seqs=4, max_num_batched_tokens=64))
    # 4 seqs -> buckets 0..2; 64 tokens -> buckets 0..6 (no LM head here: every layer sees prefill).
    assert plan.choices == {f"{OUT}x{IN}": [available[0]] * 7, f"32x{IN}": [available[0]] * 7}


@pytest.mark.skipif(not backend_supports("fp32_stream", torch.empty(1, 1)), reason="no working C compiler here")
def test_forced_fp32_stream_on_a_bfloat16_model_runs_fp32_cpu_and_says_why(caplog):
    """The streaming schedule is float32 only: a bfloat16 layer forced onto it takes the same
    kernel's other schedule (which widens bfloat16 weights), not F.linear, and the log says why."""
    layer = make_linear(bias=False, dtype=torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger=linear_chooser.__name__):
        plan = choose_plan(torch.nn.Sequential(layer), LinearSetup("fp32_stream", 2, 2))
    assert set(plan.choices[f"{OUT}x{IN}"]) == {"fp32_cpu"}
    assert plan.summary() == "linear backends: fp32_cpu for 1 shapes (2 buckets), forced by --linear-backend"
    assert (f"linear backend fp32_stream cannot run 1 of 1 weight shapes here (fp32_stream runs float32 weights "
            f"only; fp32_cpu is the same kernel for bfloat16); instead: {OUT}x{IN} torch.bfloat16 on cpu through "
            f"fp32_cpu") in caplog.text


def test_setup_rejects_unknown_backend():
    with pytest.raises(ValueError, match="linear_backend must be one of .*got 'blas'"):
        LinearSetup("blas")


def test_cheap_measured_plan_is_applied_and_cached(tmp_path, monkeypatch):
    """A cheap chooser run (two shapes, two M buckets): every bucket gets one of the measured
    backends, each layer follows its shape's plan, and the second start reads the cache."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    monkeypatch.setattr(linear_chooser.OtherCpuUse, "cores", lambda self: 0.0)
    model = torch.nn.Sequential(make_linear(True), make_linear(False, seed=1, out=48))
    setup = LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=2)
    plan = plan_linears(model, setup)
    assert not plan.cached and set(plan.choices) == {f"{OUT}x{IN}", f"48x{IN}"}
    for key, choice in plan.choices.items():
        assert len(choice) == 2 and set(choice) <= set(available)
        assert set(plan.timings_ms[key]) == set(available)
        assert all(len(ms) == 2 and all(t > 0 for t in ms) for ms in plan.timings_ms[key].values())
    for layer in model:
        expected = plan.choices[f"{layer.weight.shape[0]}x{IN}"]
        assert [layer.backend_for(m) for m in (1, 2)] == expected
    files = list((tmp_path / "linear").glob("plan-*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["choices"] == plan.choices
    again = choose_plan(model, setup)
    assert again.cached and again.choices == plan.choices
    assert "read from the cache" in again.summary()


def test_a_cached_plan_serves_engines_with_fewer_buckets(tmp_path, monkeypatch):
    """Bucket b is timed at the same M whatever their number: a plan measured for a larger step
    budget is read, cut to its first buckets, by an engine with a smaller one; a larger budget
    than any cached measures again and its plan replaces the cached one."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    monkeypatch.setattr(linear_chooser.OtherCpuUse, "cores", lambda self: 0.0)
    model = torch.nn.Sequential(make_linear(False))
    key = f"{OUT}x{IN}"
    wide = choose_plan(model, LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=8))
    assert not wide.cached and len(wide.choices[key]) == 4  # M buckets 1, 2, 3-4, 5-8
    narrow = choose_plan(model, LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=2))
    assert narrow.cached and narrow.choices[key] == wide.choices[key][:2]
    assert all(ms == wide.timings_ms[key][b][:2] for b, ms in narrow.timings_ms[key].items())
    wider = choose_plan(model, LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=16))
    assert not wider.cached and len(wider.choices[key]) == 5
    assert choose_plan(model, LinearSetup("auto", max_num_seqs=2, max_num_batched_tokens=8)).cached
    assert len(list((tmp_path / "linear").glob("plan-*.json"))) == 1


def test_busy_machine_measurement_is_remeasured_once_the_machine_is_quiet(tmp_path, monkeypatch):
    """Measured busy: cached and reused while the machine stays busy, measured again (and the
    quiet plan cached) on the first start that finds it quiet; a quiet plan is then kept."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    model, setup = torch.nn.Sequential(make_linear(False)), LinearSetup("auto", 1, 1)
    others = {"cores": 1.5}
    monkeypatch.setattr(linear_chooser.OtherCpuUse, "cores", lambda self: others["cores"])
    busy = choose_plan(model, setup)
    assert not busy.cached and busy.other_cores == 1.5 and len(busy.choices[f"{OUT}x{IN}"]) == 1
    assert choose_plan(model, setup).cached  # still busy: the busy plan is reused
    others["cores"] = 0.05
    quiet = choose_plan(model, setup)
    assert not quiet.cached and quiet.other_cores == 0.05
    others["cores"] = 1.5
    again = choose_plan(model, setup)
    assert again.cached and again.other_cores == 0.05


def test_other_cpu_use_counts_a_child_process_and_subtracts_this_ones():
    """A child process spinning 0.6 s of CPU shows as other processes' CPU time; this process
    spinning shows in the machine's busy time and in its own, which ``cores`` subtracts."""
    import subprocess
    import sys

    use = linear_chooser.OtherCpuUse()
    subprocess.run([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass"],
                   check=True)
    _, machine_s, own_s = use.seconds()
    assert machine_s - own_s >= 0.55
    own = linear_chooser.OtherCpuUse()
    t = time.process_time()
    while time.process_time() - t < 0.6:
        pass
    _, machine_s, own_s = own.seconds()
    assert own_s >= 0.6 and machine_s >= own_s - 0.05  # /proc/stat counts in 10 ms ticks


def test_summary_counts_shapes_and_buckets():
    plan = LinearPlan({"a": ["onednn", "onednn", "mkl"], "b": ["onednn"]}, took_s=3.21)
    assert plan.summary() == "linear backends: onednn for 2 shapes (3 buckets), mkl for 1 shapes (1 buckets), chosen in 3.2 s"
    quantized = LinearPlan({"int8:960x576": ["int8_cpu"], "int8a8:576x576": ["int8_cpu"], "int8a8:3072x576": ["int8_cpu"]},
                           cached=True)
    assert quantized.summary() == ("linear backends: int8_cpu for 3 shapes (3 buckets) (int8 weights: 3 shapes, 2 of "
                                   "them with 8-bit activations), read from the cache")


def test_a_single_candidate_is_chosen_without_timing(monkeypatch):
    """float16 (and a CUDA weight) leave only F.linear: nothing is timed, the layer stays unplanned."""
    monkeypatch.setattr(linear_chooser, "time_backends_ms", lambda *a: pytest.fail("timed a lone candidate"))
    model = torch.nn.Sequential(make_linear(False, dtype=torch.float16))
    plan = linear_chooser.measure(linear_chooser._layer_buckets(model, LinearSetup("auto", 2, 4)), BACKENDS)
    assert plan.choices == {f"{OUT}x{IN}": ["torch"] * 3}


def test_weight_copies_span_twice_the_last_level_cache():
    """The chooser rotates through enough copies that a call reads its weight from DRAM."""
    llc = 32 << 20
    assert linear_chooser.num_weight_copies(torch.empty(1024, 1024), llc) == 16  # 4 MiB each
    assert linear_chooser.num_weight_copies(torch.empty(49152, 576), llc) == 1  # the LM head: 108 MiB
    assert linear_chooser.num_weight_copies(torch.empty(4, 4), llc) == linear_chooser.MAX_WEIGHT_COPIES
    assert linear_chooser.last_level_cache_bytes() >= 1 << 20


def test_timed_calls_rotate_through_the_copies_backends_in_turn(monkeypatch):
    """After the warm-up on copy 0, the backends alternate call by call and each call reads the
    copy after the previous call's, so no backend runs on a weight another just pulled into
    the caches."""
    seen = []
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    monkeypatch.setattr(linear_chooser, "bind_backend", lambda backend, prepared, weight, bias, scale, bits:
                        lambda x: seen.append((backend, prepared, weight.data_ptr())))
    weights = [torch.zeros(8, 4) for _ in range(3)]
    prepared = {"mkl": ["m0", "m1", "m2"], "torch": [None, None, None]}
    times = linear_chooser.time_backends_ms(prepared, weights, 2)
    assert set(times) == {"mkl", "torch"}
    ptr = [w.data_ptr() for w in weights]
    assert seen[:2] == [("mkl", "m0", ptr[0]), ("torch", None, ptr[0])]
    backends = ("mkl", "torch") * linear_chooser.MIN_CALLS
    expected = [(b, prepared[b][(k + 1) % 3], ptr[(k + 1) % 3]) for k, b in enumerate(backends)]
    assert seen[2:] == expected
    assert all(a[2] != b[2] for a, b in zip(seen[2:], seen[3:]))


def test_a_bfloat16_model_plans_and_runs_on_every_cpu(tmp_path, monkeypatch):
    """oneDNN's bfloat16 needs AVX-512 or AVX-NE-CONVERT: where the CPU lacks them (an AVX2
    EPYC) the plan leaves bfloat16 layers on F.linear or Tandem's kernel (which widens bfloat16
    weights on any CPU) instead of failing the start-up."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(linear_chooser, "TIME_PER_CANDIDATE_S", 0.0)
    onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and torch.backends.mkldnn.is_available()
    assert backend_supports("onednn", torch.empty(1, 1, dtype=torch.bfloat16)) == onednn_bf16
    layer = make_linear(bias=True, dtype=torch.bfloat16)
    plan = plan_linears(torch.nn.Sequential(layer), LinearSetup("auto", 2, 2))
    cpu_kernel = {"fp32_cpu"} if backend_supports("fp32_cpu", layer.weight) else set()
    assert set(plan.choices[f"{OUT}x{IN}"]) <= ({"onednn", "torch"} if onednn_bf16 else {"torch"}) | cpu_kernel
    x = torch.randn(2, IN).to(torch.bfloat16)
    torch.testing.assert_close(layer(x).float(), F.linear(x, layer.weight, layer.bias).float(), **BF16_TOL)
