"""core.cost_model: the fit recovers known coefficients, stays non-negative and defined, and the
predictions are exact arithmetic on the coefficients."""

from __future__ import annotations

import math

import numpy as np
import pytest

from core.cost_model import (
    ATTN_PAIRS_UNIT, BandwidthMeter, CostModel, StepSample, StepTimeFit, prefill_attn_pairs,
)

TRUE = CostModel(base_s=0.004, per_token_s=2e-5, per_seq_s=3e-4, per_attn_s=1e-6)


def synthetic(model: CostModel, noise: float = 0.0, seed: int = 0) -> list[StepSample]:
    """Prefill chunks of several sizes and contexts plus decode batches of several sizes."""
    rng = np.random.default_rng(seed)
    shapes = []
    for n in (16, 64, 200, 512):
        for c in (0, 128, 700):
            shapes.append((n, 1, prefill_attn_pairs(n, c)))
    for b in (1, 2, 8, 32):
        for k in (64, 400):
            shapes.append((b, b, b * prefill_attn_pairs(1, k)))
    samples = []
    for n, s, a in shapes:
        t = model.step_s(n, s, a) * (1 + noise * rng.standard_normal())
        samples.append(StepSample(n, s, a, t))
    return samples


def fitted(samples: list[StepSample], **kw) -> StepTimeFit:
    fit = StepTimeFit(**kw)
    for sample in samples:
        fit.add(sample)
    return fit


def test_prefill_attn_pairs_exact():
    assert prefill_attn_pairs(8, 0) == 8 * 4.5 / ATTN_PAIRS_UNIT  # the causal triangle with the diagonal
    assert prefill_attn_pairs(4, 16) == 4 * 18.5 / 1000
    assert prefill_attn_pairs(1, 20) == 21 / 1000  # a decode attends its 20 cached keys and itself


def test_fit_recovers_known_coefficients_exactly_without_noise():
    coef = fitted(synthetic(TRUE)).fit()
    assert coef == pytest.approx((TRUE.base_s, TRUE.per_token_s, TRUE.per_seq_s, TRUE.per_attn_s), rel=1e-3)


def test_fit_with_noise_predicts_within_a_few_percent():
    fit = fitted(synthetic(TRUE, noise=0.02, seed=1) * 4)
    model = fit.model()
    assert model.num_samples == len(fit) == 4 * 20
    for n, c in ((100, 0), (512, 512), (30, 2000)):
        assert model.prefill_s(n, c) == pytest.approx(TRUE.prefill_s(n, c), rel=0.05)
    assert model.decode_step_s(16, 16 * 300) == pytest.approx(TRUE.decode_step_s(16, 16 * 300), rel=0.05)


def test_fit_ignores_steps_slowed_by_a_neighbour():
    """30% of the steps took 20x longer (CPU contention): the robust fit predicts within 1% of the
    truth, where relative least squares on the same samples is off by more than 5%."""
    samples = synthetic(TRUE) * 5
    slowed = [StepSample(s.num_new_tokens, s.num_seqs, s.attn_pairs, 20 * s.duration_s) if i % 10 in (1, 4, 7) else s
              for i, s in enumerate(samples)]
    shapes = [(s.num_new_tokens, s.num_seqs, s.attn_pairs) for s in samples[:20]]

    def worst_error(model: CostModel) -> float:
        return max(abs(model.step_s(*shape) / TRUE.step_s(*shape) - 1) for shape in shapes)

    assert worst_error(fitted(slowed).model()) < 0.01
    assert worst_error(fitted(slowed, robust_iterations=0).model()) > 0.05


def test_coefficients_stay_non_negative():
    """Timings that fall with batch size would want a negative per_seq_s: it is pinned at 0."""
    samples = [StepSample(b, b, 0.0, 0.010 - 0.0001 * b) for b in range(1, 40)]
    coef = fitted(samples).fit()
    assert all(c >= 0 for c in coef)
    assert coef[2] == 0.0 and coef[1] == 0.0
    assert coef[0] == pytest.approx(np.mean([s.duration_s for s in samples]), rel=0.05)


def test_ridge_keeps_degenerate_samples_defined():
    """Only identical single-sequence decodes: every feature is constant (collinear with the
    intercept), yet the fit is finite and predicts that step."""
    samples = [StepSample(1, 1, 0.05, 0.02)] * 10
    fit = fitted(samples)
    coef = fit.fit()
    assert all(math.isfinite(c) and c >= 0 for c in coef)
    assert fit.model().step_s(1, 1, 0.05) == pytest.approx(0.02, rel=1e-3)


def test_empty_fit_and_bad_samples():
    fit = StepTimeFit(window=4)
    assert fit.fit() == (0.0, 0.0, 0.0, 0.0)
    fit.add(StepSample(1, 1, 0.0, float("nan")))
    fit.add(StepSample(1, 1, 0.0, -1.0))
    assert len(fit) == 0
    for i in range(6):
        fit.add(StepSample(i + 1, 1, 0.0, 0.01))
    assert len(fit) == 4  # the window
    fit.clear()
    assert len(fit) == 0
    with pytest.raises(ValueError, match="window must be >= 4, got 3"):
        StepTimeFit(window=3)
    with pytest.raises(ValueError, match="robust_iterations must be >= 0, got -1"):
        StepTimeFit(robust_iterations=-1)


def test_prefill_s_chunks_exactly():
    model = CostModel(base_s=0.01, per_token_s=0.001, per_seq_s=0.002, per_attn_s=0.0001, max_num_batched_tokens=8)
    # 20 tokens after 4 cached: chunks of 8 (after 4), 8 (after 12), 4 (after 20)
    expected = sum(0.01 + 0.001 * n + 0.002 + 0.0001 * n * (c + (n + 1) / 2) / 1000
                   for n, c in ((8, 4), (8, 12), (4, 20)))
    assert model.prefill_s(20, 4) == pytest.approx(expected, rel=1e-12)
    assert model.prefill_s(8) == pytest.approx(0.01 + 0.008 + 0.002 + 0.0001 * 0.036, rel=1e-12)
    assert model.prefill_s(0, 100) == 0.0
    assert model.decode_step_s(4, 1000) == pytest.approx(0.01 + 0.004 + 0.008 + 0.0001, rel=1e-12)


def test_kv_load_s():
    model = CostModel(kv_load_bytes_per_s=1e9, kv_bytes_per_token=1000.0)
    assert model.kv_load_s(500) == pytest.approx(5e-4, rel=1e-12)
    assert model.kv_load_s(0) == 0.0
    assert CostModel(kv_bytes_per_token=1000.0).kv_load_s(500) == 0.0  # bandwidth not measured yet


def test_bandwidth_meter_ewma():
    meter = BandwidthMeter(alpha=0.5)
    meter.record(0, 1.0)  # an empty transfer
    meter.record(100, 0.0)  # no measurable duration
    assert (meter.bytes_per_s, meter.num_transfers) == (0.0, 0)
    meter.record(1000, 1.0)
    meter.record(3000, 1.0)
    assert (meter.bytes_per_s, meter.num_transfers) == (2000.0, 2)
    with pytest.raises(ValueError, match="alpha must be in"):
        BandwidthMeter(alpha=0.0)



def test_a_step_sample_splits_the_pass_into_forward_and_host_time():
    pass_ = StepSample(16, 2, 0.5, duration_s=0.050, forward_s=0.046)
    assert pass_.host_s == pytest.approx(0.004)
    assert StepSample(16, 2, 0.5, 0.050).host_s == 0.0  # forward not timed apart
    assert StepSample(16, 2, 0.5, 0.040, forward_s=0.046).host_s == 0.0  # never negative
