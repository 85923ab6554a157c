"""docs/design.md §3's import rules, checked on the source (docs/architecture.md lists them).

- ``core`` imports no torch and no other first-party package;
- ``router`` and ``kv_pool`` import only ``core`` (their images stay CPU-only and small);
- ``engine`` imports only ``core``; the workers import ``core`` and ``engine``, never each other;
- no module imports itself back: the source has no import cycle, in any package.

Statically every ``import`` in every module counts, function-level ones included; dynamically,
importing every module of ``core``, ``router`` and ``kv_pool`` in a fresh interpreter must not
load torch (a third-party library could pull it in) nor any engine or worker module.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Collection
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Not searched for cycles: the tests, and the generated stubs (tandem.v1, which import nothing of ours).
NOT_SOURCE = {"tests", "proto"}
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


def source_modules(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every first-party module under ``root`` (a package by its
    ``__init__.py``), outside NOT_SOURCE and hidden folders."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[0] in NOT_SOURCE or any(part.startswith(".") for part in parts):
            continue
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: Collection[str]) -> set[str]:
    """The modules of ``modules`` that module ``name`` imports, at module or function level,
    relative imports resolved: ``from a.b import c`` is ``a.b.c`` when that is a module, else
    ``a.b``; a name outside ``modules`` counts as its nearest enclosing module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)
    return found - {name}


def import_cycles(root: Path) -> list[list[str]]:
    """Every set of modules under ``root`` that import each other in a loop (the strongly
    connected components of the import graph with more than one module), each sorted."""
    modules = source_modules(root)
    graph = {name: sorted(imported_modules(name, path, modules)) for name, path in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(name: str) -> None:  # Tarjan's algorithm
        index[name] = low[name] = len(index)
        stack.append(name)
        for other in graph[name]:
            if other not in index:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], index[other])
        if low[name] == index[name]:
            component = []
            while not component or component[-1] != name:
                component.append(stack.pop())
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return sorted(cycles)


def test_no_module_imports_itself_back() -> None:
    assert import_cycles(ROOT) == []


def test_the_check_catches_an_import_cycle(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name, text in {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub import b\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "def f():\n    from ..c import g  # lazily: still a cycle\n",
        "pkg/c.py": "import os\nimport pkg.a\ng = 1\n",
        "pkg/d.py": "from pkg import a, c\n",  # imports the cycle, is not part of it
    }.items():
        (tmp_path / name).write_text(text)
    assert import_cycles(tmp_path) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
