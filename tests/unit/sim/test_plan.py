"""``tandem plan`` on the test slice: splits, the early stop, the recommendation, Helm values."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from sim import plan as planner
from sim.cli import plan

ROOT = Path(__file__).parents[3]
SLICE = ROOT / "tests/data/mooncake_conversation_slice.jsonl"


def test_splits_cover_colocated_and_prefill_shares():
    assert planner.splits(1) == [0]
    assert planner.splits(4) == [0, 1, 2, 3]
    assert planner.splits(16) == [0, 2, 4, 6, 8, 10, 12]


def test_bisection_visits_few_sizes_and_finds_the_smallest_that_meets_the_target(monkeypatch):
    # A fake evaluation: attainment 1 from 8 GPUs up (any split), 0.5 below; counts the sizes visited.
    visited = []

    def fake(args):
        tp, p, d, _ = args
        n = (p + d) * tp
        visited.append(n)
        attainment = 1.0 if n >= 8 else 0.5
        return planner.PlanPoint(n, tp, p, d, float(n), attainment, 0, 0, False, attainment)

    monkeypatch.setattr(planner, "_evaluate_job", fake)
    points = planner.search([], planner.ClusterChoice(1, 1, block_size=16), [2, 4, 8, 16, 32, 64, 128], [1],
                            planner.SLO(), 0.9, jobs=1)
    assert sorted(set(visited)) == [4, 8, 16]  # 16, then 4, then 8: log2 of 7 sizes
    assert planner.recommend(points, 0.9).num_gpus == 8
    assert planner.not_evaluated([2, 4, 8, 16, 32, 64, 128], [1], points, 0.9) == (
        "not evaluated: 2 GPUs (fewer than 4, which misses the 90% target), 32, 64, 128 GPUs (more than 8, which "
        "meets the 90% target); SLO attainment grows with GPUs, so the bisection skips them, --all-sizes evaluates "
        "every size")
    assert planner.not_evaluated([4, 8, 16], [1], points, 0.9) is None
    assert planner.not_evaluated([4, 6, 8, 16], [4], points, 0.9) == "not evaluated: 6 GPUs (no --tp degree divides them)"


def test_recommend_takes_the_fewest_gpus_that_meet_the_target():
    point = lambda n, p, good, att, aborted=False: planner.PlanPoint(n, 1, p, n - p or n, good, att, 0, 0, aborted)  # noqa: E731
    points = [point(2, 0, 1.0, 0.5), point(2, 1, 1.1, 0.8, True), point(4, 0, 2.0, 0.95), point(4, 1, 2.1, 0.96),
              point(8, 2, 3.0, 1.0)]
    best = planner.recommend(points, 0.9)
    assert (best.num_gpus, best.num_prefill) == (4, 1)
    assert planner.recommend(points[:2], 0.9) is None


def test_plan_command_prints_a_recommendation_and_valid_helm_values(tmp_path):
    values = tmp_path / "values.yaml"
    result = CliRunner().invoke(plan, ["--path", str(SLICE), "--gpus", "2,4", "--time-scale", "0.01", "--out",
                                       str(tmp_path), "--helm-values", str(values), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    assert "recommendation:" in result.output
    assert ("\nnot evaluated: 4 GPUs (more than 2, which meets the 90% target); SLO attainment grows with GPUs, so the "
            "bisection skips them, --all-sizes evaluates every size\n") in result.output
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [p["num_prefill"] for p in data["points"]] == [0, 1]
    assert (tmp_path / "goodput_vs_gpus.png").exists()
    overrides = yaml.safe_load(values.read_text())
    rec = data["recommendation"]
    assert overrides["prefill"]["replicas"] == rec["num_prefill"] and overrides["decode"]["replicas"] == rec["num_decode"]
    planner.validate_values(overrides, ROOT / "deploy/k8s/helm/tandem")


def test_helm_values_outside_the_schema_are_refused():
    with pytest.raises(jsonschema.ValidationError):
        planner.validate_values({"engine": {"blockSize": 24}}, ROOT / "deploy/k8s/helm/tandem")


def test_a_hopeless_configuration_stops_early():
    from sim.setup import ClusterChoice, build_worker
    from sim.cluster import ClusterSpec
    from sim.simulator import Simulation
    from sim.workload import load_trace
    from bench.metrics import SLO

    worker = build_worker(ClusterChoice(1, 1), 1)
    requests = load_trace(SLICE, "mooncake", time_scale=0.0001)
    result = Simulation(ClusterSpec(0, 1, worker, worker)).run(requests, SLO(ttft_ms=1, tbt_ms=1), max_misses=0)
    # The first request is still prefilling when its 1 ms TTFT SLO passes: a certain miss, so the
    # run stops there, before any request ends and before most have arrived.
    assert result.aborted and result.num_misses == 1
    assert sum(r.e2e_s is not None for r in result.records) == 0
    assert result.num_arrived < len(requests)
    assert result.records[0].ttft_s is None


def test_fine_splits_follow_what_a_stopped_run_saw_and_stop_once_they_cannot_win(monkeypatch):
    # A fake evaluation of 8 workers (1000 requests, target 0.9): 6P + 2D stops early with 35 %
    # over all requests but had seen 89 % (the real 24P + 8D of the full trace did); 7P + 1D meets.
    seen = {}

    def fake(args):
        tp, p, d, max_misses = args
        seen[p] = max_misses
        attainment, arrived, aborted = {0: (0.01, 0.1, True), 2: (0.1, 0.3, True), 4: (0.2, 0.4, True),
                                        6: (0.35, 0.89, True), 5: (0.3, 0.6, True), 7: (0.93, 0.93, False)}[p]
        return planner.PlanPoint(8, tp, p, d, attainment * 10, attainment, 0, 0, aborted, arrived)

    monkeypatch.setattr(planner, "_evaluate_job", fake)
    finder = planner.Search([None] * 1000, planner.ClusterChoice(1, 1, block_size=16), [1], planner.SLO(), 0.9)
    points = finder.size(8)
    assert sorted(seen) == [0, 2, 4, 5, 6, 7]  # the fine splits next to 6P + 2D were tried
    assert seen == {0: None, 2: None, 4: None, 6: None, 5: None, 7: None}  # no coarse split met the target
    best = planner.recommend(points, 0.9)
    assert (best.num_prefill, best.num_decode) == (7, 1)
    assert finder.best_share == 7 / 8  # the next size runs the splits near 7/8 first
    assert finder._longest_first((1, 14, 2)) < finder._longest_first((1, 8, 8)) < finder._longest_first((1, 0, 16))

    # At 16 workers 12P + 4D meets the target with 60 misses of 1000: its fine splits may miss no more.
    seen.clear()

    def fake16(args):
        tp, p, d, max_misses = args
        seen[p] = max_misses
        attainment = {0: 0.5, 4: 0.6, 8: 0.8, 12: 0.94, 10: 0.9, 14: 0.92}[p]
        return planner.PlanPoint(16, tp, p, d, attainment * 10, attainment, 0, 0, False, attainment)

    monkeypatch.setattr(planner, "_evaluate_job", fake16)
    finder.size(16)
    assert seen == {0: None, 4: None, 8: None, 12: None, 10: 60, 14: 60}


def test_plan_helm_values_name_the_model_its_source_and_a_context_it_supports(tmp_path):
    """`tandem plan --helm-values` for Llama-3.1-8B: the repo, bf16 and its 131,072 positions; on a
    machine without the repo `tandem up -f` says so instead of failing on the context or serving
    the bundled model under that name."""
    values = tmp_path / "values.yaml"
    result = CliRunner().invoke(plan, ["--path", str(SLICE), "--gpus", "2", "--time-scale", "0.01", "--out",
                                       str(tmp_path), "--helm-values", str(values), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    model = yaml.safe_load(values.read_text())["model"]
    assert model == {"name": "Llama-3.1-8B-Instruct", "dtype": "bfloat16", "maxModelLen": 131072,
                     "source": {"type": "huggingface", "huggingface": {"repo": "meta-llama/Llama-3.1-8B-Instruct"}}}
    import huggingface_hub.constants

    from tandem_cli.main import main

    original = huggingface_hub.constants.HF_HUB_CACHE
    huggingface_hub.constants.HF_HUB_CACHE = str(tmp_path / "empty-hf-cache")
    try:
        up = CliRunner().invoke(main, ["up", "-f", str(values), "--print-config"], terminal_width=400)
    finally:
        huggingface_hub.constants.HF_HUB_CACHE = original
    assert up.exit_code == 2 and "the Hugging Face repo meta-llama/Llama-3.1-8B-Instruct (revision main)" in up.output


def test_plan_helm_values_for_the_bundled_model_start_with_tandem_up(tmp_path):
    overrides = planner.helm_values(planner.PlanPoint(2, 1, 1, 1, 1.0, 1.0, 0, 0, False),
                                    planner.ClusterChoice(1, 1, model="smollm2-135m", block_size=16), 1024, 2048,
                                    planner.SLO())
    assert overrides["model"] == {"name": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "maxModelLen": 2048,
                                  "source": {"type": "pypi", "pypi": {"model": "SmolLM2-135M-Instruct"}}}
    planner.validate_values(overrides, ROOT / "deploy/k8s/helm/tandem")
    with pytest.raises(ValueError, match="max_model_len 9000 exceeds smollm2-135m's 8192"):
        planner.model_values(planner.MODELS["smollm2-135m"], 9000)


def test_stopped_runs_print_as_bounds_and_close_goodputs_as_a_tie():
    point = lambda p, good, aborted=False: planner.PlanPoint(4, 1, p, 4 - p or 4, good, 0.95, 0, 0, aborted)  # noqa: E731
    assert planner.bound("12.50", True) == ">= 12.50" and planner.bound("12.50", False) == "12.50"
    assert planner.ratio_text(point(2, 16.0, aborted=True), point(0, 2.0)) == ">= 8.00x"
    assert planner.ratio_text(point(2, 16.0), point(0, 2.0, aborted=True)) == "<= 8.00x"
    assert planner.ratio_text(point(2, 16.0, True), point(0, 2.0, True)) == "? (both stopped early)"
    assert planner.ratio_text(point(2, 20.31), point(0, 20.25)) == "1.00x"
    disaggregated, colocated = point(2, 20.31), point(0, 20.25)
    assert planner.ties([disaggregated, colocated], disaggregated, 0.9) == colocated
    assert planner.ties([disaggregated, point(0, 15.0)], disaggregated, 0.9) is None  # 26 % apart
    assert planner.ties([disaggregated, point(0, 20.25, aborted=True)], disaggregated, 0.9) is None


def test_the_plot_writes_gpu_counts_and_marks_stopped_runs():
    points = [planner.PlanPoint(n, 1, p, n - p or n, float(n), 0.9, 0, 0, aborted=(n == 2 and p == 1))
              for n in (2, 4, 8) for p in (0, 1)]
    fig = planner.plan_figure(points, "t")
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8"]
        assert "stopped early: goodput is a lower bound" in [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
