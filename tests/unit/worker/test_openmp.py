"""The bounded OpenMP spin a worker sets before torch loads (worker/openmp.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.openmp import SPIN_COUNT, bound_openmp_spin

REPO = Path(__file__).resolve().parents[3]


def test_an_unset_wait_gets_the_bounded_spin():
    environ = {"OMP_NUM_THREADS": "2"}
    assert bound_openmp_spin(environ) is True
    assert environ == {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": str(SPIN_COUNT)}


@pytest.mark.parametrize("name, value", [("OMP_WAIT_POLICY", "ACTIVE"), ("OMP_WAIT_POLICY", "PASSIVE"),
                                         ("GOMP_SPINCOUNT", "300000"), ("GOMP_SPINCOUNT", "")])
def test_a_users_own_wait_is_kept(name, value):
    environ = {name: value}
    assert bound_openmp_spin(environ) is False
    assert environ == {name: value}


@pytest.mark.parametrize("package", ["decode_worker", "prefill_worker"])
def test_each_worker_package_sets_it_before_torch_loads(package):
    """What the worker's ``python -m`` sees: the variable set, torch not yet imported (the
    OpenMP runtime reads it once, as torch loads it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(REPO)
    probe = f"import os, sys, {package}; print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == [str(SPIN_COUNT), "False"]
