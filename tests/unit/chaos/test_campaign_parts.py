"""chaos from plain values: schedule parsing (errors name the field), outcome counting against
references, throughput recovery from token times, the markdown row."""

from __future__ import annotations

import json

from pathlib import Path

import pytest

from bench.workloads import BenchRequest
from chaos.campaign import ScenarioResult, count, recovery_of, result_json
from chaos.driver import Outcome, Progress
from chaos.faults import FaultLog
from chaos.recovery import BASELINE_TOLERANCE, Recovery
from chaos.reference import reference_key
from chaos.report import failed, markdown
from chaos.schedule import Fault, parse_campaign

CAMPAIGN = {
    "seed": 3, "deadline_s": 60,
    "cluster": {"num_decode_workers": 2},
    "workload": {"kind": "prompts", "num_requests": 4, "max_tokens": 8, "concurrency": 2},
    "scenarios": [
        {"name": "hang", "faults": [{"at_tokens": 10, "do": "sigstop", "service": "decode-1", "duration_s": 5}]},
        {"name": "redis", "faults": [{"at_s": 1, "do": "redis_restart"}]},
    ],
}


def test_a_campaign_parses_into_checked_values():
    campaign = parse_campaign(CAMPAIGN)
    assert (campaign.seed, campaign.deadline_s, campaign.concurrency) == (3, 60.0, 2)
    assert campaign.workload == {"kind": "prompts", "num_requests": 4, "max_tokens": 8}
    hang, redis = campaign.scenarios
    assert hang.faults == (Fault("sigstop", at_tokens=10, service="decode-1", duration_s=5),)
    assert hang.faults[0].label == "sigstop decode-1 @ 10 tokens for 5 s"
    assert redis.faults[0].label == "redis_restart @ 1 s"


@pytest.mark.parametrize(("fault", "message"), [
    ({"at_s": 1, "do": "explode"}, "scenarios\\[0\\].faults\\[0\\]: do must be one of"),
    ({"do": "sigkill", "service": "decode"}, "exactly one of at_s and at_tokens"),
    ({"at_s": 1, "at_tokens": 3, "do": "sigkill", "service": "decode"}, "exactly one of at_s and at_tokens"),
    ({"at_s": 1, "do": "sigkill"}, "sigkill needs service"),
    ({"at_s": 1, "do": "disconnect", "stage": "later"}, "stage must be one of"),
    ({"at_s": 1, "do": "abort_storm", "fraction": 2}, "fraction and probability must be in \\[0, 1\\]"),
    ({"at_s": 1, "do": "burst", "when": 3}, "unknown fault field\\(s\\) \\['when'\\]"),
    ({"at_s": 1, "do": "partition", "service": "decode", "duration_s": 5, "direction": "up"}, "direction must be one of"),
    ({"at_s": 1, "do": "partition", "service": "decode"}, "partition needs duration_s > 0"),
    ({"at_s": 1, "do": "slow_link", "service": "router", "duration_s": 5},
     "slow_link needs a worker, pool node or redis"),
    ({"at_s": 1, "do": "partition", "service": "redis", "duration_s": 5},
     "partition: client .* goes with service redis"),
    ({"at_s": 1, "do": "partition", "service": "decode", "client": "router", "duration_s": 5},
     "partition: client .* goes with service redis and only with it"),
    ({"at_s": 1, "do": "partition", "service": "redis", "client": "redis", "duration_s": 5},
     "client must be a router, worker or pool node service, got 'redis'"),
    ({"at_s": 1, "do": "throttle_link", "service": "decode", "duration_s": 5}, "throttle_link needs bytes_per_s >= 1"),
    ({"at_s": 1, "do": "drop_connections", "service": "decode", "duration_s": 5, "probability": 1.5},
     "fraction and probability must be in \\[0, 1\\]"),
    ({"at_s": 1, "do": "drop_connections", "service": "decode"}, "drop_connections needs duration_s > 0"),
])
def test_bad_faults_are_refused_naming_the_field(fault, message):
    with pytest.raises(ValueError, match=message):
        parse_campaign({"scenarios": [{"name": "x", "faults": [fault]}]})


def test_link_faults_name_their_proxy_and_label():
    redis = Fault("partition", at_s=2, service="redis", client="decode-1", duration_s=8)
    assert (redis.link, redis.label) == ("redis/decode-1", "partition redis from decode-1 @ 2 s for 8 s")
    throttle = Fault("throttle_link", at_tokens=5, service="kv_pool", bytes_per_s=65536, duration_s=4)
    assert (throttle.link, throttle.label) == ("kv_pool", "throttle_link kv_pool 65536 B/s @ 5 tokens for 4 s")
    drop = Fault("drop_connections", at_s=1, service="redis", client="router", probability=0.25, duration_s=3)
    assert (drop.link, drop.label) == ("redis/router", "drop_connections redis from router p=0.25 @ 1 s for 3 s")


def test_a_campaign_without_scenarios_or_with_unknown_keys_is_refused():
    with pytest.raises(ValueError, match="scenarios must not be empty"):
        parse_campaign({"seed": 1})
    with pytest.raises(ValueError, match="unknown campaign field\\(s\\) \\['sed'\\]"):
        parse_campaign({"sed": 1, "scenarios": [{"name": "x"}]})


def test_outcomes_are_counted_and_wrong_answers_found():
    requests = [BenchRequest("a", 4), BenchRequest("b", 4)]
    refs = {reference_key(requests[0]): "alpha", reference_key(requests[1]): "beta"}
    outcomes = [Outcome(0, 0, 0.0, status="completed", text="alpha", num_attempts=2),  # retried on another router
                Outcome(1, 1, 0.0, status="completed", text="bet", num_attempts=1),
                Outcome(2, 0, 0.0, status="error"), Outcome(3, 1, 0.0, status="lost"),
                Outcome(4, 0, 0.0, status="cancelled", text="al")]
    assert count(outcomes, requests, refs) == {"sent": 5, "completed": 2, "retried": 1, "error": 1, "lost": 1,
                                               "wrong": 1, "cancelled": 1}
    assert count(outcomes, requests, None)["wrong"] == 0


def test_recovery_runs_from_the_first_faults_start_to_the_last_ones_end():
    progress = Progress()
    # 16 tokens/s for 6 s, nothing during the faults (6-9 s), 16 tokens/s again from 9 s
    progress.token_times_s = [i / 16 for i in range(96)] + [9 + i / 16 for i in range(64)]
    first = FaultLog(Fault("sigstop", at_s=6, service="decode", duration_s=2), start_s=6.0, end_s=8.0, note="")
    second = FaultLog(Fault("sigstop", at_s=7, service="decode-1", duration_s=2), start_s=7.0, end_s=9.0, note="")
    # the baseline is 64 tokens / 4 s from 2 s (after the ramp) to 6 s (to 7 s: / 5 s); (9, 11] is
    # the first window wholly after the last heal: 31 tokens (9.0 itself is out), 97 % of it (from
    # 8 s: (8, 10] would hold 16, and the bar first met at 10.75 s)
    assert recovery_of(progress, [second, first]) == Recovery(16.0, 0.0, 1.0, 2.0, 2.0)
    assert recovery_of(progress, []) == Recovery()


def test_the_markdown_row_and_missed_targets():
    result = ScenarioResult("hang", [FaultLog(Fault("sigstop", at_s=1, service="decode"), 1.0, 1.0, "")],
                            {"sent": 4, "completed": 3, "retried": 2, "error": 1, "lost": 0, "wrong": 0, "cancelled": 0},
                            {"kv_pool.num_leases": 2}, None, 3 * 1024 * 1024,
                            Recovery(20.0, 0.08, 0.85, to_half_s=2.25, to_baseline_s=None, other_cores_baseline=0.5,
                                     other_cores_after_heal=1.25), 10.0,
                            other_cores=[(1.04, 0.333), (2.06, 0.5)])
    table = markdown([result])
    assert table.splitlines()[0].startswith("| scenario | faults | sent | completed | retried | explicit errors |")
    assert table.splitlines()[0].endswith(
        f"| recovery to 50% of baseline (s) | recovery to {100 - round(100 * BASELINE_TOLERANCE)}% of baseline (s) "
        "| other jobs' CPU, baseline → after heal (cores) | detected (s) |")
    assert table.splitlines()[2] == ("| hang | sigstop decode @ 1 s | 4 | 3 | 2 | 1 | 0 | 0 | 0 | 2 (kv_pool.num_leases=2) "
                                     "| n/a | 3.0 | 2.2 | n/a | 0.5 → 1.2 | n/a |")
    recovery = result_json(result)["recovery"]
    assert {k: v for k, v in recovery.items() if k != "measure"} == {
        "baseline_tokens_per_s": 20.0, "baseline_spread": 0.08, "baseline_lowest": 0.85, "to_half_s": 2.25,
        "to_baseline_s": None, "other_cores_baseline": 0.5, "other_cores_after_heal": 1.25}
    assert result_json(result)["other_cores"] == [[1.0, 0.33], [2.1, 0.5]]
    assert recovery["measure"].startswith("seconds from the last fault's end until the token rate over 2 s is at least "
                                          "0.5 (to_half_s) and ")
    assert failed([result]) == ["hang: {'leaked': 2}"]


def test_detection_is_the_first_marked_down_line_of_the_worker_after_the_fault(tmp_path):
    from chaos.campaign import detect_s

    lines = [{"ts": 99.0, "msg": "worker 127.0.0.1:7 marked down: before the fault"},
             {"ts": 104.5, "msg": "worker 127.0.0.1:8 marked down: another worker"},
             {"ts": 106.0, "msg": "decode worker 127.0.0.1:7 failed"},
             {"ts": 107.25, "msg": "worker 127.0.0.1:7 marked down: decode: ping timeout"}]
    (tmp_path / "router-0.log").write_text("\n".join(json.dumps(x) for x in lines) + "\nnot json\n")
    (tmp_path / "router-1.log").write_text(json.dumps({"ts": 108.0, "msg": "worker 127.0.0.1:7 marked down"}) + "\n")
    logs = [tmp_path / "router-0.log", tmp_path / "router-1.log", tmp_path / "missing.log"]
    assert detect_s(logs, ("marked down", "127.0.0.1:7"), 100.0) == 7.25
    assert detect_s(logs, ("marked down", "127.0.0.1:9"), 100.0) is None
    assert detect_s(logs, ("127.0.0.1:7", "failed"), 100.0) == 6.0


def test_a_campaigns_relative_trace_path_is_read_from_the_data_folder(tmp_path, monkeypatch):
    """chaos/campaigns/soak.yaml names its trace by file name only: the data folder holds it."""
    import yaml

    from chaos.cli import workload
    from chaos.schedule import load_campaign

    soak = load_campaign(Path(__file__).parents[3] / "chaos" / "campaigns" / "soak.yaml")
    monkeypatch.setenv("TANDEM_DATA_DIR", str(tmp_path))
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")  # not beside the caller
    with pytest.raises(ValueError) as info:
        workload(soak)
    assert str(info.value).startswith(f"workload: no file {tmp_path / 'mooncake_fast25_conversation_trace.jsonl'}; "
                                      "get the Mooncake FAST'25 conversation trace")
    (tmp_path / "mooncake_fast25_conversation_trace.jsonl").write_text("")
    assert workload(soak).path == tmp_path / "mooncake_fast25_conversation_trace.jsonl"
    own = dict(yaml.safe_load(yaml.safe_dump(CAMPAIGN)), workload={"kind": "mooncake", "path": str(tmp_path / "t.jsonl")})
    (tmp_path / "t.jsonl").write_text("")
    assert workload(parse_campaign(own)).path == tmp_path / "t.jsonl"  # an absolute path is itself


def test_a_link_fault_on_a_service_the_cluster_does_not_run_is_refused():
    """A proxy in front of a worker that is never started sits on no one's path: the fault would
    silently do nothing (a prefill-1 partition on a cluster of one prefill worker)."""
    from chaos.cli import check_link_services
    from launcher.config import ClusterConfig

    config = ClusterConfig.from_options(num_prefill_workers=1, num_decode_workers=2)
    fine = [Fault("partition", at_s=1, service="prefill", duration_s=5),
            Fault("partition", at_s=1, service="redis", client="decode-1", duration_s=5),
            Fault("throttle_link", at_s=1, service="kv_pool", bytes_per_s=10, duration_s=5)]
    check_link_services(config, fine)
    with pytest.raises(ValueError, match="partition prefill-1 @ 1 s for 5 s: the cluster runs no 'prefill-1' "
                                         "\\(its services: prefill, decode, decode-1, kv_pool\\)"):
        check_link_services(config, [Fault("partition", at_s=1, service="prefill-1", duration_s=5)])
    with pytest.raises(ValueError, match="the cluster runs no 'router-1'"):
        check_link_services(config, [Fault("partition", at_s=1, service="redis", client="router-1", duration_s=5)])


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[3] / "chaos" / "campaigns").glob("*.yaml")),
                         ids=lambda p: p.name)
def test_every_shipped_campaign_parses_and_its_link_faults_name_services_it_runs(path):
    from chaos.cli import check_link_services, cluster_config
    from chaos.schedule import LINK_FAULTS, load_campaign

    campaign = load_campaign(path)
    config = cluster_config(campaign, "SmolLM2-135M-Instruct", Path("logs"))
    check_link_services(config, [f for s in campaign.scenarios for f in s.faults if f.do in LINK_FAULTS])
