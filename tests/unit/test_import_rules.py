"""DESIGN.md §3's import rules, checked on the source (docs/architecture.md lists them).

- ``core`` imports no torch and no other first-party package;
- ``router`` and ``kv_pool`` import only ``core`` (their images stay CPU-only and small);
- ``engine`` imports only ``core``; the workers import ``core`` and ``engine``, never each other.

Statically every ``import`` in every module counts, function-level ones included; dynamically,
importing every module of ``core``, ``router`` and ``kv_pool`` in a fresh interpreter must not
load torch (a third-party library could pull it in) nor any engine or worker module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"core", "engine", "prefill_worker", "decode_worker", "kv_pool", "router", "launcher", "bench",
               "benchmarks", "tandem", "tests"}
# Package -> the first-party packages it may import (tandem: the generated stubs) and whether torch.
RULES: dict[str, tuple[frozenset[str], bool]] = {
    "core": (frozenset({"core", "tandem"}), False),
    "router": (frozenset({"core", "router", "tandem"}), False),
    "kv_pool": (frozenset({"core", "kv_pool", "tandem"}), False),
    "engine": (frozenset({"core", "engine", "tandem"}), True),
    "prefill_worker": (frozenset({"core", "engine", "prefill_worker", "tandem"}), True),
    "decode_worker": (frozenset({"core", "engine", "decode_worker", "tandem"}), True),
}
# Modules that import the NIXL library, which imports torch itself: loaded only when NIXL is on
# (a worker, or a pool started with --nixl on), never by a plain router or pool.
TORCH_VIA_NIXL = {"core.kv_transfer.nixl_backend", "kv_pool.nixl_agent"}


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path`` (module- and function-level)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def violations(package: str) -> list[str]:
    allowed, torch_ok = RULES[package]
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        imported = imported_packages(path)
        bad = sorted((imported & FIRST_PARTY) - allowed)
        if not torch_ok and "torch" in imported:
            bad.append("torch")
        if bad:
            found.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    return found


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_imports_only_what_design_allows(package: str) -> None:
    assert violations(package) == []


def test_the_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from engine.scheduler import Scheduler\n    import torch.nn\n")
    assert imported_packages(module) == {"os", "engine", "torch"}


def test_cpu_only_packages_load_no_torch_and_no_engine() -> None:
    script = f"""
import importlib, json, pkgutil, sys
skipped = {sorted(TORCH_VIA_NIXL)!r}
for pkg in ("core", "router", "kv_pool"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name not in skipped and not info.name.endswith("__main__"):
            importlib.import_module(info.name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "engine", "prefill_worker", "decode_worker"))
print(json.dumps(loaded))
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == []
