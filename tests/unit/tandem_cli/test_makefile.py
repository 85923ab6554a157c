"""`make up` and `make demo` pass ARGS on to tandem up (README: a second cluster on other ports)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def recipe(*make_args: str) -> list[str]:
    """The commands ``make -n`` prints (nothing runs), trailing blanks stripped."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    out = subprocess.run(["make", "-n", "-C", str(ROOT), "--no-print-directory", *make_args],
                         capture_output=True, text=True, check=True).stdout
    return [line.rstrip() for line in out.splitlines()]


def test_make_up_passes_args() -> None:
    assert recipe("up", "ARGS=--http-port 8001 --grpc-port 50051") == [
        "bash scripts/setup.sh", ".venv/bin/tandem up --http-port 8001 --grpc-port 50051"]


def test_make_up_and_demo_without_args() -> None:
    assert recipe("up")[-1] == ".venv/bin/tandem up"
    assert recipe("demo", "ARGS=--num-prompts 2")[-1] == ".venv/bin/tandem up --demo --num-prompts 2"
