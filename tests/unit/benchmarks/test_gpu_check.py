"""benchmarks/gpu_check.sh without a GPU: a clear refusal, and ``--cpu-smoke`` runs every part
of the script (kernels under the Triton interpreter, toy-model greedy check) and prints the table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, run benchmarks/gpu_check.sh itself")


def run_script(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


def test_refuses_without_gpu():
    proc = run_script()
    assert proc.returncode == 2
    assert "no CUDA GPU is present" in proc.stderr


def test_cpu_smoke_prints_one_passing_table():
    pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
    proc = run_script("--cpu-smoke")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for check in ("kv-cache write", "block pack", "block unpack", "decode attention", "prefill attention",
                  "end-to-end greedy vs HF"):
        assert check in proc.stdout
    assert "FAIL" not in proc.stdout
    assert "1/1 equal" in proc.stdout


def test_tensor_parallel_check_says_it_was_skipped_below_two_gpus():
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from benchmarks.gpu_check import tensor_parallel_rows

    [row] = tensor_parallel_rows(torch.device("cpu"), "SmolLM2-135M-Instruct")
    assert row.name == "end-to-end greedy vs HF, TP=2" and row.ok
    assert row.note == "skipped: 0 GPU visible, TP=2 needs 2"
