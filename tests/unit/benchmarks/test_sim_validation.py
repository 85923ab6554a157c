"""benchmarks/step_timeline.py and sim_validation's measured terms from given numbers (no cluster)."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_validation
from benchmarks.step_timeline import Pass, analyze, contention, overlap_fraction, read_passes
from core.cost_model import CostModel, StepSample


def decode_pass(worker: str, end_s: float, duration_s: float, batch: int = 1) -> Pass:
    return Pass(worker, end_s, StepSample(batch, batch, batch / 1000, duration_s, duration_s - 0.001))


def test_overlap_fraction_merges_the_neighbours_passes():
    p = decode_pass("decode", end_s=10.0, duration_s=1.0)  # [9, 10)
    # [8.8, 9.3) and [9.2, 9.5) overlap each other: together they cover [9, 9.5) of it (not 0.6);
    # [11, 12) does not touch it.
    others = [decode_pass("prefill", 9.3, 0.5), decode_pass("prefill", 9.5, 0.3), decode_pass("prefill", 12.0, 1.0)]
    assert overlap_fraction(p, others) == pytest.approx(0.5)
    assert overlap_fraction(p, []) == 0.0
    # 2 decode threads + 1 prefill thread on 2 cores: contended while a prefill pass runs, at
    # processor sharing's 3 / 2; the two prefill passes overlap in [9.2, 9.3): 4 threads, 2x.
    contended, modelled = contention(p, others, {"decode": 2, "prefill": 1}, num_cores=2)
    assert contended == pytest.approx(0.5)
    assert modelled == pytest.approx(0.4 * 1.5 + 0.1 * 2.0 + 0.5 * 1.0)
    assert contention(p, others, {"decode": 1, "prefill": 1}, num_cores=2) == pytest.approx((0.1, 0.1 * 1.5 + 0.9))


def test_analyze_measures_the_slowdown_of_passes_beside_another_worker():
    # decode passes of 20 ms + 10 ms per sequence alone; twice that while the prefill worker's
    # long passes run; the prefill worker only runs between t = 100 and 110 s.
    decode, t = [], 0.0
    for i in range(40):
        batch = 1 + i % 4
        shared = 100 <= t < 109
        t += (0.020 + 0.010 * batch) * (2 if shared else 1)
        decode.append(decode_pass("decode", t, (0.020 + 0.010 * batch) * (2 if shared else 1), batch))
        if i == 20:
            t = 100.0
    prefill = [Pass("prefill", 100.0 + 1.0 * k, StepSample(256, 1, 30.0, 1.0, 0.999)) for k in range(1, 11)]
    result = analyze({"decode": decode, "prefill": prefill})
    row = result["decode"]
    assert row["num_passes"] == 40 and row["num_shared"] > 0 and row["num_alone"] > 0
    assert row["alone_pass_over_fit_p10_p50_p90"] == pytest.approx([1.0, 1.0, 1.0], abs=0.02)
    assert row["fitted_pass_over_fit_p10_p50_p90"] == row["alone_pass_over_fit_p10_p50_p90"]  # fitted on those
    assert row["measured_slowdown_p50"] == pytest.approx(2.0, rel=0.02)
    assert row["host_ms_p10_p50_p90"] == pytest.approx([1.0, 1.0, 1.0])
    assert "prefill" in result  # 10 passes: analysed too


def test_read_passes_parses_the_engines_debug_lines(tmp_path):
    lines = [{"ts": 5.0, "level": "info", "logger": "x", "msg": "serving"},
             {"ts": 6.5, "level": "debug", "logger": "engine.engine",
              "msg": "pass: 16 tokens, 1 seqs, 0.136 k attention pairs, forward 40.000 ms, pass 42.500 ms"},
             {"ts": 4.0, "level": "debug", "logger": "engine.engine",
              "msg": "pass: 2 tokens, 2 seqs, 0.030 k attention pairs, forward 10.000 ms, pass 11.000 ms"}]
    log = tmp_path / "decode.log"
    log.write_text("\n".join(json.dumps(line) for line in lines))
    (p,) = read_passes(log, since_s=5.0)  # the pass that ended at 4.0 s is before the run
    assert (p.worker, p.end_s, p.sample) == ("decode", 6.5, StepSample(16, 1, 0.136, 0.0425, 0.040))


def test_the_router_overhead_is_the_probes_ttft_beyond_their_own_passes():
    prefill = CostModel(base_s=0.030, per_token_s=0.001, num_samples=1, kv_load_bytes_per_s=1e6, kv_bytes_per_token=1000)
    models = {"prefill": prefill, "decode": CostModel(base_s=0.5, num_samples=1)}
    # client TTFTs 60, 70, 80 ms; the workers timed the probes' passes 45, 46 ms on the prefill
    # worker (+ 16 ms to store 16 tokens' KV at 1 MB/s) and 47 ms on the decode worker (no store):
    # overheads -1, 8, 33 ms -> median 8 ms.
    passes = [("prefill", 0.045), ("prefill", 0.046), ("decode", 0.047)]
    assert sim_validation.request_overhead_s([0.060, 0.070, 0.080], passes, models) == pytest.approx(0.008)
    # no pass timings: the prefill fit's 30 + 16 = 46 ms pass and the store: 70 - 46 - 16 = 8 ms
    assert sim_validation.request_overhead_s([0.060, 0.070, 0.080], [], models) == pytest.approx(0.008)
    assert sim_validation.request_overhead_s([0.010], [("decode", 0.045)], models) == 0.0


def test_the_cores_are_shared_as_the_launcher_splits_them():
    assert sim_validation.sharing_of("colocated-1", 2).decode_threads == 2
    one_one = sim_validation.sharing_of("1P+1D", 2)
    assert (one_one.num_cores, one_one.prefill_threads, one_one.decode_threads) == (2, 1, 1)
    two_two = sim_validation.sharing_of("2P+2D", 2)
    assert (two_two.prefill_threads, two_two.decode_threads) == (1, 1)
    assert sim_validation.sharing_of("colocated-2", 2).decode_threads == 1


def test_the_simulated_roles_take_the_fits_of_their_uncontended_passes():
    published = {"prefill": CostModel(0.5, 0.01, 0.0, 0.0, 20, 2048, 2e9, 46080.0),
                 "decode": CostModel(0.05, 0.002, 0.001, 0.0, 30, 2048, 1e9, 46080.0)}
    fit = lambda base_ms: {"base_ms": base_ms, "per_token_us": 2000.0, "per_seq_us": 500.0, "per_attn_us": 1.0}  # noqa: E731
    row = lambda base_ms, median=1.0: {"fit_on_alone_passes": fit(base_ms),  # noqa: E731
                                       "fitted_pass_over_fit_p10_p50_p90": [0.9, median, 2.0]}
    timeline = {"prefill": row(40.0), "decode": row(20.0), "decode-1": row(30.0)}
    models = sim_validation.uncontended_models(published, timeline)
    assert models["prefill"] == CostModel(0.040, 0.002, 0.0005, 1e-6, 20, 2048, 2e9, 46080.0)
    assert models["decode"].base_s == pytest.approx(0.025)  # the median of the two decode workers
    assert models["decode"].kv_load_bytes_per_s == 1e9  # bandwidth and budget stay the published ones
    assert sim_validation.uncontended_models(published, {}) == published  # no pass logs: the published fits
    # a fit whose passes ran 1.2x it at the median is scaled up by 1.2 (the prefill one here)
    timeline["prefill"] = row(40.0, median=1.2)
    scaled = sim_validation.uncontended_models(published, timeline)["prefill"]
    assert (scaled.base_s, scaled.per_token_s, scaled.per_seq_s) == pytest.approx((0.048, 0.0024, 0.0006))
    unscaled = sim_validation.uncontended_models(published, timeline, median_scaled=False)["prefill"]
    assert unscaled.base_s == pytest.approx(0.040)


def test_the_pass_over_fit_ratios_are_kept_by_kind_of_step():
    # decode passes of exactly 20 ms + 10 ms per sequence (batches 1-4) and prefill passes of
    # 29 ms + 1 ms per token (base 20, 1 per token, 9 per sequence): the fit is exact, every ratio
    # 1, grouped by sim.adapter.step_size
    passes = [decode_pass("decode", 1.0 * i, 0.020 + 0.010 * (1 + i % 4), 1 + i % 4) for i in range(16)]
    passes += [Pass("decode", 100.0 + i, StepSample(n, 1, 0.0, 0.029 + 0.001 * n, 0.028 + 0.001 * n))
               for i, n in enumerate((16, 64, 128, 256))]
    row = analyze({"decode": passes})["decode"]
    kinds = row["pass_over_fit"]
    assert sorted(size for size, _ in kinds["decode"]) == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    assert sorted(size for size, _ in kinds["prefill"]) == [16, 64, 128, 256]
    assert all(r == pytest.approx(1.0, abs=1e-3) for v in kinds.values() for _, r in v)


def test_each_role_gets_its_measured_core_sharing_exponent():
    sharing = sim_validation.sharing_of("1P+1D", 2)
    # decode passes beside a prefill pass ran 1.0x (processor sharing: 1.5x), prefill ones 1.5x:
    # exponents 0 and 1; the shared one is their median 0.5
    timeline = {"decode": {"modelled_slowdown_p50": 1.5, "measured_slowdown_p50": 1.0},
                "prefill": {"modelled_slowdown_p50": 1.5, "measured_slowdown_p50": 1.5}}
    measured = sim_validation.measured_sharing(sharing, timeline)
    assert (measured.decode_exponent, measured.prefill_exponent) == pytest.approx((0.0, 1.0))
    assert measured.exponent == pytest.approx(0.5)
    assert sim_validation.measured_sharing(sharing, {}) == sharing  # nothing contended: processor sharing


def test_jitter_ratios_pool_each_roles_workers_and_a_colocated_prefill_is_the_decode_workers():
    timeline = {"decode": {"pass_over_fit": {"decode": [[1, 1.0], [2, 1.1]], "prefill": [[300, 0.9]]}},
                "decode-1": {"pass_over_fit": {"decode": [[1, 1.2]]}}}
    ratios = sim_validation.jitter_ratios(timeline)
    assert ratios["decode"] == {"decode": [(1, 1.0), (2, 1.1), (1, 1.2)], "prefill": [(300, 0.9)]}
    assert ratios["prefill"] is ratios["decode"]


def test_jittered_simulations_report_the_median_over_the_seeds():
    requests = [sim_validation.BenchRequest(list(range(100 + i, 140 + i)), 4, 0.5 * i, 40) for i in range(6)]
    arrivals = sim_validation.ArrivalConfig("poisson", rate_per_s=2.0, seed=0)
    cost = CostModel(0.010, 0.001, 0.0, 0.0, 1, 2048, 0.0, 46080.0)
    models = {"prefill": cost, "decode": cost}
    plain = sim_validation.simulate("colocated-1", requests, arrivals, models, 0.0, None)
    ones = {"decode": {"decode": [(1, 1.0)] * 8, "prefill": [(40, 1.0)] * 8}}
    ones["prefill"] = ones["decode"]
    same = sim_validation.simulate("colocated-1", requests, arrivals, models, 0.0, None, ones, num_seeds=3)
    assert same["ttft_ms"]["p50"] == pytest.approx(plain["ttft_ms"]["p50"])  # ratio 1 everywhere: the fit
    assert same["seeds"]["ttft_ms_p50"] == pytest.approx([plain["ttft_ms"]["p50"]] * 3)
    spread = {"decode": {"decode": [(1, 0.5), (1, 2.0)] * 4, "prefill": [(40, 0.5), (40, 2.0)] * 4}}
    spread["prefill"] = spread["decode"]
    jittered = sim_validation.simulate("colocated-1", requests, arrivals, models, 0.0, None, spread, num_seeds=5)
    seeds = jittered["seeds"]["tbt_ms_p90"]
    assert len(set(seeds)) > 1 and jittered["tbt_ms"]["p90"] == pytest.approx(sorted(seeds)[2])


def write_log(path, entries) -> None:
    path.write_text("\n".join(json.dumps({"level": "debug", "logger": "engine.engine", **e}) for e in entries))


def pass_line(ts: float, tokens: int, seqs: int, ms: float) -> dict:
    return {"ts": ts, "msg": f"pass: {tokens} tokens, {seqs} seqs, 0.000 k attention pairs, forward {ms - 0.5:.3f} ms, "
                             f"pass {ms:.3f} ms"}


def test_the_routers_view_is_replayed_from_the_pass_log_as_the_worker_fitted_it(tmp_path):
    # A warm-up pass (dropped: the calibration clears the fit), 8 calibration passes of 20 ms +
    # 2 ms per token, the "calibrated" line, then (after the replay starts at ts 100) passes of
    # 10 ms + 1 ms per token: the schedule starts at the calibration's fit and moves as the worker's
    # StepStats refits (on every pass while it holds fewer than 16).
    cal = [(1, 1), (16, 1), (64, 1), (4, 4), (8, 8), (32, 2), (128, 1), (2, 2)]
    entries = [pass_line(1.0, 16, 1, 900.0)]
    entries += [pass_line(2.0 + i, n, s, 20.0 + 2.0 * n) for i, (n, s) in enumerate(cal)]
    entries += [{"ts": 11.0, "level": "info", "logger": "worker.runtime",
                 "msg": "cost model calibrated: 8 passes in 4.00 s; base 20.00 ms"}]
    entries += [pass_line(101.0 + i, n, s, 10.0 + 1.0 * n) for i, (n, s) in enumerate(cal * 4)]
    log_dir = tmp_path / "1P+1D"
    log_dir.mkdir()
    write_log(log_dir / "decode.log", entries)
    published = {"decode": CostModel(0.5, 0.5, 0.0, 0.0, 1, 2048, 3e9, 46080.0)}
    (schedule,) = sim_validation.published_schedules(log_dir, since_s=100.0, published=published)["decode"]
    start_s, first = schedule[0]
    assert start_s == 0.0 and (first.base_s, first.per_token_s) == pytest.approx((0.020, 0.002), rel=1e-3)
    assert (first.kv_load_bytes_per_s, first.max_num_batched_tokens) == (3e9, 2048)  # the published fields
    assert [t for t, _ in schedule[1:]] == sorted(t for t, _ in schedule[1:]) and schedule[1][0] == 1.0
    assert sim_validation.published_schedules(log_dir, 100.0, published)["prefill"][0] == schedule  # colocated
    # what the worker had seen before the replay: the warm-up, the calibration (the probes' passes too)
    before = sim_validation.before_replay(log_dir, since_s=100.0)["decode"]
    assert len(before) == 9 and before[1].duration_s == pytest.approx(0.022)
