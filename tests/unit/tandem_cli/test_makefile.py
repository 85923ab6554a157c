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


def test_make_test_sets_up_the_test_extras_and_make_demo_only_serving() -> None:
    assert recipe("test")[0] == "bash scripts/setup.sh --test"
    assert recipe("demo")[0] == "bash scripts/setup.sh"


def test_optional_parts_are_extras() -> None:
    """Serving needs neither Ray, NIXL nor Triton: they are extras (README: Requirements), and
    the test set-up installs all of them (the suite has Ray, NIXL and Triton-interpreter tests)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {dep.split("=")[0].split("<")[0].split(">")[0].strip() for dep in project["dependencies"]}
    assert "torch" in names and not names & {"ray", "nixl", "triton"}
    extras = project["optional-dependencies"]
    assert extras["ray"] == ["ray"] and extras["nixl"] == ["nixl==1.5.1"] and extras["gpu"] == ["triton"]
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert 'extras="dev,ray,gpu"' in setup and '"nixl==1.5.1"' in setup
    assert "torch==2.13.0+cpu" in setup and "https://download.pytorch.org/whl/cpu" in setup


def test_the_readme_states_the_requirements_and_keeps_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    requirements = readme.split("## Requirements", 1)[1].split("\n## ", 1)[0]
    for needed in ("Python ≥ 3.10", "Redis", "C compiler", "Disk", "Memory", "CUDA build", "CPU build",
                   'pip install -e ".[ray,nixl,gpu]"'):
        assert needed in requirements, needed
    commands = readme.split("## The two commands", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert [line.split("#")[0].strip() for line in commands.splitlines()] == ["make demo", "make test"]
