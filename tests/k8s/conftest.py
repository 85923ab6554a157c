"""Proofs on a real Kubernetes node: the local node of deploy/tools/k8s-local with the release of
deploy/k8s/helm/values-single-node-cpu.yaml (``make k8s-up``). Opt-in: ``make k8s-test`` sets
TANDEM_K8S_TEST=1; without it every test here is skipped (``make test`` collects them).

Each proof leaves the release as it found it (one prefill and one decode worker serving, the
autoscaler off) and reports its numbers: requests sent, completed, lost, wrong, times to Ready,
rollout and drain durations. They are printed at the end of the run and, with
TANDEM_K8S_REPORT=FILE, written there as JSON.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.k8s.load import PROMPTS, expected
from tests.k8s.node import Node

HERE = Path(__file__).resolve().parent
_RESULTS: list[dict] = []


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TANDEM_K8S_TEST") == "1":
        return
    skip = pytest.mark.skip(reason="needs the local Kubernetes node: make k8s-up, then make k8s-test")
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    if not _RESULTS:
        return
    terminalreporter.section("proofs on the Kubernetes node")
    for result in _RESULTS:
        terminalreporter.write_line(json.dumps(result))
    if os.environ.get("TANDEM_K8S_REPORT"):
        Path(os.environ["TANDEM_K8S_REPORT"]).write_text(json.dumps(_RESULTS, indent=1) + "\n")


@pytest.fixture(scope="session")
def node() -> Node:
    node = Node()
    node.wait_serving(prefill=1, decode=1, timeout_s=120)
    return node


@pytest.fixture(scope="session")
def references() -> None:
    """Every prompt's HF answer, computed before any load (its CPU time stays out of the runs)."""
    for prompt in PROMPTS:
        expected(prompt)


@pytest.fixture
def record():
    """``record(proof, **numbers)``: one line of the run's report."""
    def add(proof: str, **numbers) -> None:
        _RESULTS.append({"proof": proof, **numbers})
    return add


@pytest.fixture
def baseline(node):
    """The release as every proof starts and leaves it: 1 prefill + 1 decode serving."""
    node.wait_serving(prefill=1, decode=1)
    yield node
    node.wait_serving(prefill=1, decode=1)
