"""engine.core_share: the prefill (owner) and decode (borrower) sides of core sharing, with real
flock(2) locks. Two CoreShare objects open the files separately, so their locks conflict as two
processes' would, which lets most cases run in one process."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
from prometheus_client import CollectorRegistry

from engine.core_share import CoreShare, CoreShareMetrics


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _share(tmp_path, role, base=1, extra=0, **kw):
    registry = CollectorRegistry()
    share = CoreShare(tmp_path, role, base, extra, metrics=CoreShareMetrics(registry), **kw)
    share.registry = registry
    return share


def _passes(share, cores):
    return share.registry.get_sample_value("tandem:core_share_passes_total", {"cores": cores}) or 0.0


def test_a_borrower_alone_runs_on_the_idle_cores_and_gives_them_back_when_idle(tmp_path, restore_threads):
    torch.set_num_threads(1)
    decode = _share(tmp_path, "borrower", base=1, extra=2)
    decode.busy()
    assert decode.holding and decode.threads == 3 and torch.get_num_threads() == 3
    decode.between_passes()
    assert torch.get_num_threads() == 3 and _passes(decode, "borrowed") == 1
    decode.idle()
    assert not decode.holding and torch.get_num_threads() == 1
    decode.close()


def test_an_owner_with_work_takes_its_cores_back_between_two_passes(tmp_path, restore_threads):
    torch.set_num_threads(1)
    decode = _share(tmp_path, "borrower", base=1, extra=1)
    prefill = _share(tmp_path, "owner", base=1, wait_s=30.0)
    decode.between_passes()
    assert decode.holding and torch.get_num_threads() == 2

    taken = threading.Event()
    owner = threading.Thread(target=lambda: (prefill.busy(), taken.set()))
    owner.start()
    deadline = time.monotonic() + 10  # the owner announces itself at once, then waits for the pass to end
    while not _owner_wants(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.001)
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
    decode.close()
    prefill.close()


def test_an_owner_runs_beside_a_borrower_that_keeps_the_cores_past_wait_s(tmp_path, restore_threads):
    torch.set_num_threads(1)
    decode = _share(tmp_path, "borrower", base=1, extra=1)
    prefill = _share(tmp_path, "owner", base=1, wait_s=0.05)
    decode.between_passes()
    prefill.busy()  # the borrower never ends its pass: the owner goes on after wait_s
    assert prefill.holding and prefill._slow_waits == 1
    decode.between_passes()  # ...and the borrower leaves at its next pass boundary
    assert not decode.holding
    prefill.idle()
    prefill.busy()  # nobody holds them now: no wait past wait_s
    assert prefill._slow_waits == 1
    decode.close()
    prefill.close()


def test_an_owner_does_not_wait_past_wait_s_for_a_borrower_frozen_in_its_check(tmp_path):
    """A borrower stopped (SIGSTOP, a frozen cgroup) in the instant it holds ``want`` exclusively."""
    frozen = os.open(tmp_path / "want", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(frozen, fcntl.LOCK_EX)
    prefill = _share(tmp_path, "owner", base=1, wait_s=0.05)
    try:
        prefill.busy()
        assert prefill.holding and prefill._slow_waits == 1
        assert prefill.registry.get_sample_value("tandem:core_share_wait_seconds_total") >= 0.05
        prefill.idle()
        fcntl.flock(frozen, fcntl.LOCK_UN)
        prefill.busy()  # thawed: both locks at once
        assert prefill._slow_waits == 1
    finally:
        prefill.close()
        os.close(frozen)


def test_both_pass_series_exist_from_the_start(tmp_path):
    decode = _share(tmp_path, "borrower", base=1, extra=1)
    assert _passes(decode, "own") == 0 and _passes(decode, "borrowed") == 0
    assert decode.registry.get_sample_value("tandem:core_share_passes_total", {"cores": "own"}) == 0.0
    decode.close()


def test_one_borrower_at_a_time(tmp_path, restore_threads):
    torch.set_num_threads(1)
    first = _share(tmp_path, "borrower", base=1, extra=1)
    second = _share(tmp_path, "borrower", base=1, extra=1)
    first.between_passes()
    second.between_passes()
    assert first.holding and not second.holding and second.threads == 1
    first.idle()
    second.between_passes()
    assert second.holding
    first.close()
    second.close()


def test_a_killed_owner_leaves_no_lock_behind(tmp_path, restore_threads):
    torch.set_num_threads(1)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from engine.core_share import CoreShare; "
                               f"s = CoreShare({str(tmp_path)!r}, 'owner', 1); s.busy(); print('busy', flush=True); "
                               "sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "busy"
        decode = _share(tmp_path, "borrower", base=1, extra=1)
        decode.between_passes()
        assert not decode.holding
        child.kill()
        child.wait(timeout=10)
        decode.between_passes()
        assert decode.holding and torch.get_num_threads() == 2
        decode.close()
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


def _owner_wants(directory) -> bool:
    probe = CoreShare(directory, "borrower", 1, 1, metrics=CoreShareMetrics(CollectorRegistry()))
    try:
        return probe.owner_wants()
    finally:
        probe.close()
