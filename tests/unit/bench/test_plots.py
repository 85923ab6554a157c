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


def run_with_settings(slo: SLO = SLO(300.0, 120.0)) -> dict:
    settings = {"model": "m", "num_requests": 4, "max_tokens": 3, "ignore_eos": True,
                "arrival": {"mode": "concurrency", "concurrency": 2}}
    return json.loads(json.dumps(run_json("sharegpt concurrency", settings, RunResult(RECORDS, duration_s=0.8),
                                          summarize(RECORDS, 0.8, slo))))


def test_the_title_carries_the_settings_and_the_slo():
    assert plots.title_of(run_with_settings()) == (
        "sharegpt concurrency\nm, 4 requests, max_tokens 3, ignore_eos, concurrency 2, SLO TTFT 300 ms, TBT 120 ms")


def test_the_cdfs_draw_the_slos():
    fig = plots.cdf_figure(run_with_settings())
    try:
        ttft, tbt, e2e = fig.axes
        assert [line.get_xdata()[0] for line in ttft.get_lines() if line.get_linestyle() == "--"] == [300.0]
        assert [line.get_xdata()[0] for line in tbt.get_lines() if line.get_linestyle() == "--"] == [120.0]
        assert [t.get_text() for t in tbt.get_legend().get_texts()] == ["measured", "SLO 120 ms"]
        assert e2e.get_legend() is None
        assert fig.get_suptitle().startswith("sharegpt concurrency\nm, 4 requests")
    finally:
        plots.plt.close(fig)


def test_tbt_over_time_colours_gaps_by_the_slo_and_says_what_the_shades_are():
    # The gaps are 100 ms and 150 ms: with a 120 ms SLO, 4 within and 4 over.
    fig = plots.tbt_figure(run_with_settings())
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "gap within the SLO (4)", "gap over the SLO (4)", "TBT SLO 120 ms", "darker dots: several gaps on one spot"]
        assert [line.get_ydata()[0] for line in ax.get_lines() if line.get_linestyle() == "--"] == [120.0]
    finally:
        plots.plt.close(fig)
