"""engine.core_share: the prefill (owner) and decode (borrower) sides of core sharing, with real
flock(2) locks. Two CoreShare objects open the files separately, so their locks conflict as two
processes' would, which lets most cases run in one process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.core_share import CoreShare, CoreShareMetrics
from tests.conftest import poll_until


@pytest.fixture
def share(tmp_path):
    """``share(role, base=1, extra=0, **kw)``: a CoreShare on ``tmp_path`` with its own metrics
    registry (``.registry``); torch starts at 1 thread; every share is closed and torch's threads
    restored after the test."""
    threads, made = torch.get_num_threads(), []
    torch.set_num_threads(1)

    def make(role, base=1, extra=0, **kw):
        registry = CollectorRegistry()
        made.append(CoreShare(tmp_path, role, base, extra, metrics=CoreShareMetrics(registry), **kw))
        made[-1].registry = registry
        return made[-1]

    yield make
    for s in made:
        s.close()
    torch.set_num_threads(threads)


def _passes(share, cores):
    return share.registry.get_sample_value("tandem:core_share_passes_total", {"cores": cores})


def test_a_borrower_alone_runs_on_the_idle_cores_and_gives_them_back_when_idle(share):
    decode = share("borrower", base=1, extra=2)
    decode.busy()
    assert decode.holding and decode.threads == 3 and torch.get_num_threads() == 3
    decode.between_passes()
    assert torch.get_num_threads() == 3 and _passes(decode, "borrowed") == 1
    decode.idle()
    assert not decode.holding and torch.get_num_threads() == 1


def test_an_owner_with_work_takes_its_cores_back_between_two_passes(share):
    decode = share("borrower", base=1, extra=1)
    prefill = share("owner", base=1, wait_s=30.0)
    decode.between_passes()
    assert decode.holding and torch.get_num_threads() == 2

    taken = threading.Event()
    owner = threading.Thread(target=lambda: (prefill.busy(), taken.set()))
    owner.start()
    # the owner announces itself at once, then waits for the pass to end
    poll_until(decode.owner_wants, message="the owner announced itself")
    assert not taken.is_set()  # the borrower's pass is still "running"
    decode.between_passes()  # the pass ended: the borrower sees the owner and gives the cores back
    owner.join(timeout=10)
    assert taken.is_set() and prefill.holding and prefill._slow_waits == 0
    assert not decode.holding and torch.get_num_threads() == 1
    assert prefill.registry.get_sample_value("tandem:core_share_wait_seconds_total") > 0

    decode.between_passes()  # prefill still busy: decode stays on its own core
    assert not decode.holding and _passes(decode, "own") == 2
    prefill.idle()
    decode.between_passes()
    assert decode.holding and torch.get_num_threads() == 2


def test_a_borrower_tells_on_threads_each_change_of_its_threads(share):
    """The decode worker's scheduler scales its mixed-step prompt tokens by the threads a pass
    runs on (engine.scheduler.Scheduler.mixed_prefill_share): told at each change, not at each pass."""
    decode = share("borrower", base=1, extra=1)
    prefill = share("owner", base=1)
    told = []
    decode.on_threads = told.append
    decode.busy()
    decode.between_passes()
    assert told == [2]
    owner = threading.Thread(target=prefill.busy)
    owner.start()
    poll_until(decode.owner_wants, message="the owner announced itself")
    decode.between_passes()  # gives the cores back
    owner.join(timeout=10)
    decode.between_passes()
    assert told == [2, 1] and prefill.holding
    prefill.idle()
    decode.between_passes()
    decode.idle()
    assert told == [2, 1, 2, 1]


def test_an_owner_runs_beside_a_borrower_that_keeps_the_cores_past_wait_s(share):
    decode = share("borrower", base=1, extra=1)
    prefill = share("owner", base=1, wait_s=0.05)
    decode.between_passes()
    prefill.busy()  # the borrower never ends its pass: the owner goes on after wait_s
    assert prefill.holding and prefill._slow_waits == 1
    decode.between_passes()  # ...and the borrower leaves at its next pass boundary
    assert not decode.holding
    prefill.idle()
    prefill.busy()  # nobody holds them now: no wait past wait_s
    assert prefill._slow_waits == 1


def test_an_owner_does_not_wait_past_wait_s_for_a_borrower_frozen_in_its_check(tmp_path, share):
    """A borrower stopped (SIGSTOP, a frozen cgroup) in the instant it holds ``want`` exclusively."""
    frozen = os.open(tmp_path / "want", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(frozen, fcntl.LOCK_EX)
    prefill = share("owner", base=1, wait_s=0.05)
    try:
        prefill.busy()
        assert prefill.holding and prefill._slow_waits == 1
        assert prefill.registry.get_sample_value("tandem:core_share_wait_seconds_total") >= 0.05
        prefill.idle()
        fcntl.flock(frozen, fcntl.LOCK_UN)
        prefill.busy()  # thawed: both locks at once
        assert prefill._slow_waits == 1
    finally:
        os.close(frozen)


def test_both_pass_series_exist_from_the_start(share):
    decode = share("borrower", base=1, extra=1)
    assert _passes(decode, "own") == 0.0 and _passes(decode, "borrowed") == 0.0  # None if missing


def test_one_borrower_at_a_time(share):
    first = share("borrower", base=1, extra=1)
    second = share("borrower", base=1, extra=1)
    first.between_passes()
    second.between_passes()
    assert first.holding and not second.holding and second.threads == 1
    first.idle()
    second.between_passes()
    assert second.holding


def test_a_killed_owner_leaves_no_lock_behind(tmp_path, share):
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from engine.core_share import CoreShare; "
                               f"s = CoreShare({str(tmp_path)!r}, 'owner', 1); s.busy(); print('busy', flush=True); "
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "busy"
        decode = share("borrower", base=1, extra=1)
        decode.between_passes()
        assert not decode.holding
        child.kill()
        child.wait(timeout=10)
        decode.between_passes()
        assert decode.holding and torch.get_num_threads() == 2
    finally:
        child.kill()
        child.wait(timeout=10)


@pytest.mark.parametrize("role, base, extra, wait_s, message", [
    ("prefill", 1, 0, 1.0, "role must be one of"),
    ("owner", 0, 0, 1.0, "base_threads must be >= 1"),
    ("owner", 1, 1, 1.0, "an owner takes no extra_threads"),
    ("borrower", 1, 0, 1.0, "a borrower needs extra_threads >= 1"),
    ("owner", 1, 0, 0.0, "wait_s must be > 0"),
])
def test_bad_arguments_are_refused(tmp_path, role, base, extra, wait_s, message):
    with pytest.raises(ValueError, match=message):
        CoreShare(tmp_path, role, base, extra, wait_s=wait_s, metrics=CoreShareMetrics(CollectorRegistry()))
    assert not list(tmp_path.iterdir())  # nothing created

