"""chaos.netfilter's rule specs and checks, with iptables replaced by a recorder (no root)."""

from __future__ import annotations

import subprocess

import pytest

from chaos.netfilter import CHAIN, Netfilter


class Recorder:
    """Answers every iptables call with success and keeps its argv."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> subprocess.CompletedProcess:
        self.calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    def appended(self) -> list[list[str]]:
        return [argv[4:] for argv in self.calls if argv[2:4] == ["-A", CHAIN]]


def test_each_kind_appends_one_rule_per_direction_with_its_match_and_target():
    runner = Recorder()
    nf = Netfilter(run=runner)
    nf.lose("10.0.0.1", "10.0.0.2", 0.25, "to_server")
    nf.reset("10.0.0.1", "10.0.0.2", "to_client")
    cap = nf.cap("10.0.0.1", "10.0.0.2", 65536, burst_bytes=4096)
    comment = ["-m", "comment", "--comment", "tandem-chaos"]
    loss, reset, cap_ab, cap_ba = runner.appended()
    assert loss == ["-s", "10.0.0.1", "-d", "10.0.0.2", "-m", "statistic", "--mode", "random", "--probability",
                    "0.25", *comment, "-j", "DROP"]
    assert reset == ["-s", "10.0.0.2", "-d", "10.0.0.1", "-p", "tcp", *comment, "-j", "REJECT", "--reject-with",
                     "tcp-reset"]
    assert cap_ab[:8] == ["-s", "10.0.0.1", "-d", "10.0.0.2", "-m", "hashlimit", "--hashlimit-above", "65536b/s"]
    assert cap_ab[8:10] == ["--hashlimit-burst", "4096b"] and cap_ba[:4] == ["-s", "10.0.0.2", "-d", "10.0.0.1"]
    # each direction its own token bucket (a hashlimit table per name), names within iptables' 15 characters
    names = [rule[rule.index("--hashlimit-name") + 1] for rule in (cap_ab, cap_ba)]
    assert names[0] != names[1] and all(len(n) <= 15 for n in names)
    assert cap.kind == "cap" and len(cap.rules) == 2
    runner.calls.clear()
    nf.heal(cap)
    assert [argv[2:4] for argv in runner.calls] == [["-D", CHAIN], ["-D", CHAIN]]


def test_two_caps_never_share_a_token_bucket():
    runner = Recorder()
    nf = Netfilter(run=runner)
    nf.cap("10.0.0.1", "10.0.0.2", 1000)
    nf.cap("10.0.0.1", "10.0.0.3", 1000)
    names = [rule[rule.index("--hashlimit-name") + 1] for rule in runner.appended()]
    assert len(set(names)) == 4


@pytest.mark.parametrize("probability", [0, 1, 1.5, -0.1])
def test_a_loss_probability_outside_0_1_is_refused(probability):
    with pytest.raises(ValueError, match=repr(probability)):
        Netfilter(run=Recorder()).lose("10.0.0.1", "10.0.0.2", probability)


def test_a_cap_under_one_byte_and_a_bad_address_are_refused():
    nf = Netfilter(run=Recorder())
    with pytest.raises(ValueError, match="0"):
        nf.cap("10.0.0.1", "10.0.0.2", 0)
    with pytest.raises(ValueError, match="'decode-0'"):
        nf.reset("decode-0", "10.0.0.2")
