"""Plots are drawn from the saved JSON (round trip through bench.report)."""

import json

import pytest

from bench.client import RequestRecord
from bench.metrics import SLO, summarize
from bench.report import run_json, save_json
from bench.runner import RunResult

plots = pytest.importorskip("bench.plots", exc_type=ImportError)  # needs matplotlib


RECORDS = [RequestRecord(i, start_s=0.1 * i, ttft_s=0.2, chunk_times_s=[0.2, 0.3, 0.45], e2e_s=0.5,
                         prompt_tokens=5, output_tokens=3, finish_reason="length") for i in range(4)]


def sweep_of(summary: dict, label: str = "") -> dict:
    """A sweep.json of two rates with the same summary."""
    return {"label": label, "settings": {}, "sweep": [{"rate_per_s": r, "summary": summary} for r in (0.5, 1.0)]}


def test_plots_read_back_the_run_json(tmp_path):
    result = RunResult(RECORDS, duration_s=0.8)
    saved = save_json(run_json("t", {}, result, summarize(RECORDS, 0.8, SLO())), tmp_path / "run.json")
    data = json.loads(saved.read_text())
    assert plots.records_of(data)[2].gaps_s == pytest.approx([0.1, 0.15])
    for path in (plots.plot_cdfs(data, tmp_path / "cdf.png"), plots.plot_tbt_over_time(data, tmp_path / "tbt.png"),
                 plots.plot_sweep(sweep_of(data["summary"]), tmp_path / "sweep.png")):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_figure_is_titled_with_the_sweeps_label():
    fig = plots.sweep_figure(sweep_of(summarize(RECORDS, 0.8, SLO()), "built-in prompts poisson rate sweep"))
    try:
        assert fig.get_suptitle() == "built-in prompts poisson rate sweep"
        assert [ax.get_xlabel() for ax in fig.axes] == ["request rate (req/s)"] * 3
    finally:
        plots.plt.close(fig)
