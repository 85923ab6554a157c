"""benchmarks/peers.py without running any system: rows, ratios to vLLM and the table from given
numbers, a peer that cannot be installed, the --systems parsing."""

from __future__ import annotations

import math

import click
import pytest
from rich.console import Console

from benchmarks import peer_report, vllm_peer
from benchmarks.peers import parse_systems


def summary(tps: float, tbt_p50_ms: float, ttft_p50_ms: float, goodput_rps: float, num_ok: int = 64) -> dict:
    return {"num_ok": num_ok, "num_requests": 64, "output_throughput_tps": tps, "request_throughput_rps": tps / 64,
            "tbt_ms": {"p50": tbt_p50_ms}, "ttft_ms": {"p50": ttft_p50_ms}, "goodput_rps": goodput_rps,
            "slo_attainment": 0.5}


def rendered(table) -> str:
    console = Console(width=300, record=True)
    console.print(table)
    return console.export_text()


def test_ratios_are_against_the_vllm_row():
    rows = peer_report.with_ratios([
        peer_report.metric_row("hf static", summary(10.0, 300.0, 4000.0, 0.0)),
        peer_report.metric_row("vllm", summary(80.0, 100.0, 500.0, 0.8)),
        peer_report.metric_row("tandem colocated", summary(60.0, 150.0, 700.0, 0.6)),
    ])
    by_name = {r["system"]: r for r in rows}
    assert by_name["vllm"]["x_tps"] == 1.0
    assert by_name["tandem colocated"]["x_tps"] == pytest.approx(0.75)
    assert by_name["tandem colocated"]["x_tbt"] == pytest.approx(1.5)  # TBT: above 1 is slower than vLLM
    assert by_name["tandem colocated"]["x_goodput"] == pytest.approx(0.75)
    assert by_name["hf static"]["x_goodput"] == 0.0
    text = rendered(peer_report.peer_table(rows))
    assert "0.75" in text and "1.50" in text and "80.0" in text


def test_unavailable_vllm_leaves_ratios_empty_and_says_why():
    reason = "not installed (no virtualenv at /x): run scripts/install_vllm.sh /x, or pass --install-vllm"
    rows = peer_report.with_ratios([
        peer_report.unavailable_row("vllm", reason),
        peer_report.metric_row("tandem colocated", summary(60.0, 150.0, 700.0, 0.6)),
    ])
    assert rows[0]["status"] == "unavailable" and "x_tps" not in rows[0]
    assert rows[1]["x_tps"] is None and rows[1]["x_tbt"] is None
    assert reason in rendered(peer_report.peer_table(rows))
    markdown = peer_report.markdown_table(rows)
    assert markdown.splitlines()[2].startswith("| vllm | - | - |")
    assert "| tandem colocated | 64/64 | 60.0 | 150 | 700 | 0.600 | - | - | - |" in markdown


def test_ratio_to_a_zero_or_missing_baseline_is_none():
    rows = peer_report.with_ratios([
        peer_report.metric_row("vllm", summary(80.0, math.nan, 500.0, 0.0)),
        peer_report.metric_row("tandem colocated", summary(60.0, 150.0, 700.0, 0.6)),
    ])
    assert rows[1]["x_goodput"] is None and rows[1]["x_tbt"] is None and rows[1]["x_tps"] == pytest.approx(0.75)


def test_missing_vllm_venv_is_reported_not_raised(tmp_path):
    versions, why = vllm_peer.vllm_versions(tmp_path / "absent")
    assert versions is None
    assert why == f"no virtualenv at {tmp_path / 'absent'}"


def test_thread_binding_lines_come_from_the_log(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("INFO started\n(EngineCore pid=1) INFO \tlocal_rank=0, core ids=[0]\n"
                   "(EngineCore pid=1) INFO \treserved_cpus=[1]\nINFO ready\n")
    assert vllm_peer.thread_binding(log) == ["local_rank=0, core ids=[0]", "reserved_cpus=[1]"]


def test_cpu_defaults_cap_the_kv_cache_and_context():
    assert vllm_peer.default_args("cpu") == ("--max-model-len", "2048", "--kv-cache-memory-bytes", "1G")
    assert vllm_peer.default_args("cuda") == ("--max-model-len", "2048")


def test_systems_keep_the_table_order_and_reject_unknown_names():
    assert parse_systems("disaggregated, vllm") == ["vllm", "disaggregated"]
    with pytest.raises(click.BadParameter, match="sglang"):
        parse_systems("vllm,sglang")


def test_vllm_cpu_bind_all_names_every_core_and_the_binding_is_read_from_its_log(tmp_path):
    from benchmarks import vllm_peer

    assert vllm_peer.cpu_bind("all", 2) == "0-1"
    assert vllm_peer.cpu_bind("all", 8) == "0-7"
    assert vllm_peer.cpu_bind("auto", 2) == "auto"
    log = tmp_path / "vllm.log"
    log.write_text("INFO 12-02 cpu_worker.py:1] auto thread-binding list (id, physical core): [(0, 0)]\n"
                   "INFO 12-02 cpu_worker.py:2] VLLM_CPU_OMP_THREADS_BIND='auto' ... local_rank=0, core ids=[0]\n")
    binding = vllm_peer.thread_binding(log)
    assert binding == ["local_rank=0, core ids=[0]"]
    assert vllm_peer.bound_cores(binding) == 1
    assert vllm_peer.bound_cores(["local_rank=0, core ids=[0, 1]"]) == 2
    assert vllm_peer.bound_cores([]) is None


def test_tandem_rows_record_linear_backends_and_thread_split(tmp_path):
    from benchmarks import peers

    (tmp_path / "decode-0.log").write_text(
        '{"msg": "linear backends: onednn for 5 shapes (58 buckets), chosen in 3.1 s", "service": "d"}\nother\n')
    (tmp_path / "router.log").write_text("nothing\n")
    assert peers.linear_backends(tmp_path) == {"decode-0": "linear backends: onednn for 5 shapes (58 buckets), chosen in 3.1 s"}
    assert peers.thread_split("colocated", ("--num-threads", "2")) == {"decode": 2}
    assert peers.thread_split("disaggregated", ("--num-threads", "2")) == {"prefill": 1, "decode": 1}
    (tmp_path / "decode-0.log").write_text(
        '{"msg": "core sharing in /tmp/c: 1 threads, 2 while prefill is idle"}\n')
    assert peers.log_lines(tmp_path, "core sharing") == {"decode-0": "core sharing in /tmp/c: 1 threads, 2 while "
                                                                     "prefill is idle"}


def test_a_system_waits_for_a_quiet_machine_and_a_busy_start_is_noted(monkeypatch):
    """wait_until_quiet probes until the other processes' cores drop to BUSY_OTHER_CORES; a row
    started beside busy cores (the wait ran out) says so in its note and its JSON."""
    from benchmarks import peers

    probes = iter([1.2, 0.9, 0.1, 5.0])
    assert peers.wait_until_quiet(max_wait_s=60, probe=lambda: next(probes)) == 0.1
    assert next(probes) == 5.0  # stopped at the first quiet window
    assert peers.wait_until_quiet(max_wait_s=0, probe=lambda: 1.5) == 1.5  # gives up at once: starts anyway

    monkeypatch.setattr(peers, "wait_until_quiet", lambda: 1.04)
    monkeypatch.setattr(peers, "_run_system", lambda key, workload, options: {"system": key, "note": ""})
    row = peers.run_system("colocated", None, None)
    assert row == {"system": "colocated", "note": "started beside 1.04 busy cores", "other_cores_at_start": 1.04}
    monkeypatch.setattr(peers, "wait_until_quiet", lambda: 0.05)
    assert peers.run_system("colocated", None, None) == {"system": "colocated", "note": "",
                                                         "other_cores_at_start": 0.05}
