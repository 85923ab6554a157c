"""docs/design.md §3's import rules, checked on the source (docs/architecture.md lists them).

The packages form layers; a package imports only those below it (and itself):

- ``core`` imports no torch and no other first-party package;
- ``router`` and ``kv_pool`` import only ``core`` (their images stay CPU-only and small);
- ``engine`` imports only ``core``; ``worker`` (the worker process) ``core`` and ``engine``; the
  two worker packages ``core``, ``engine`` and ``worker``, never each other;
- the tools: ``autoscaler`` and ``bench`` import only ``core``; ``launcher`` (the local and Ray
  clusters, a library) the services' configurations; ``sim`` the engine's scheduler, the
  router's placement and ``bench``; ``chaos`` ``launcher``, ``bench`` and the engine's model loader; ``tandem_cli`` (the
  ``tandem`` command) anything, and nothing imports it;
- no module imports itself back: the source has no import cycle, in any package.

Statically every ``import`` in every module counts, function-level ones included, and the rules
themselves must form layers (no cycle, so no import can run back up). Dynamically, importing
every module of ``core``, ``router``, ``kv_pool``, ``autoscaler`` and ``launcher`` in a fresh
interpreter must not load torch (a third-party library could pull it in) nor any engine or
worker module but the torch-free configurations the launcher composes.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Collection
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVICES = frozenset({"core", "engine", "worker", "prefill_worker", "decode_worker", "kv_pool", "router", "tandem"})
TOOLS = frozenset({"launcher", "bench", "sim", "chaos", "autoscaler", "tandem_cli", "benchmarks"})
FIRST_PARTY = SERVICES | TOOLS | {"tests"}
# Not searched for cycles: the tests, and the generated stubs (tandem.v1, which import nothing of ours).
NOT_SOURCE = {"tests", "proto"}
# Package -> the first-party packages it may import (tandem: the generated stubs) and whether torch.
RULES: dict[str, tuple[frozenset[str], bool]] = {
    "core": (frozenset({"core", "tandem"}), False),
    "router": (frozenset({"core", "router", "tandem"}), False),
    "kv_pool": (frozenset({"core", "kv_pool", "tandem"}), False),
    "engine": (frozenset({"core", "engine", "tandem"}), True),
    "worker": (frozenset({"core", "engine", "worker", "tandem"}), True),
    "prefill_worker": (frozenset({"core", "engine", "worker", "prefill_worker", "tandem"}), True),
    "decode_worker": (frozenset({"core", "engine", "worker", "decode_worker", "tandem"}), True),
    "autoscaler": (frozenset({"core", "autoscaler"}), False),
    "bench": (frozenset({"core", "bench"}), True),  # the HF baseline (bench.hf_baseline) loads torch
    "launcher": (frozenset({"core", "engine", "worker", "router", "kv_pool", "launcher", "tandem"}), False),
    "sim": (frozenset({"core", "engine", "router", "bench", "sim"}), False),
    # the greedy references (chaos.reference) load the model into HF transformers
    "chaos": (frozenset({"core", "engine", "bench", "launcher", "chaos", "tandem"}), True),
    "tandem_cli": (FIRST_PARTY - {"tests", "benchmarks"}, False),
    "benchmarks": (FIRST_PARTY - {"tests", "tandem_cli"}, True),
}
# Modules that import the NIXL library, which imports torch itself: loaded only when NIXL is on
# (a worker, or a pool started with --nixl on), never by a plain router or pool.
TORCH_VIA_NIXL = {"core.kv_transfer.nixl_backend", "kv_pool.nixl_agent"}
# Torch-free modules of the torch packages the launcher composes its configuration of.
TORCH_FREE_CONFIGS = ["engine", "engine.config", "worker", "worker.config"]


def imported_packages(path: Path) -> set[str]:
    """Top-level names of every absolute import in ``path`` (module- and function-level)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def package_files(package: str) -> list[Path]:
    folder = ROOT / ("proto/tandem" if package == "tandem" else package)
    return sorted(folder.rglob("*.py"))


def violations(package: str) -> list[str]:
    allowed, torch_ok = RULES[package]
    found = []
    for path in package_files(package):
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


def test_every_package_has_a_rule() -> None:
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() or p.name == "benchmarks"}
    assert packages - {"tests"} <= set(RULES) | {"tandem"}, sorted(packages - set(RULES))


def test_the_rules_form_layers_with_the_command_on_top() -> None:
    graph = {package: allowed - {package} for package, (allowed, _) in RULES.items()}
    try:
        order = list(TopologicalSorter(graph).static_order())  # a cycle: some import runs back up
    except CycleError as err:
        pytest.fail(f"the import rules allow a cycle: {err.args[1]}")
    assert order[0] in ("core", "tandem")
    assert [p for p, (allowed, _) in RULES.items() if "tandem_cli" in allowed and p != "tandem_cli"] == []


def test_the_check_catches_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import os\n\ndef f():\n    from engine.scheduler import Scheduler\n    import torch.nn\n")
    assert imported_packages(module) == {"os", "engine", "torch"}


def test_the_actual_imports_between_packages_have_no_cycle() -> None:
    graph = {package: {name for path in package_files(package) for name in imported_packages(path)}
                       & FIRST_PARTY - {package, "tests"} for package in RULES}
    TopologicalSorter(graph).prepare()  # raises CycleError naming the cycle


def test_cpu_only_packages_load_no_torch_and_no_engine() -> None:
    script = f"""
import importlib, json, pkgutil, sys
skipped = {sorted(TORCH_VIA_NIXL)!r}
for pkg in ("core", "router", "kv_pool", "autoscaler", "launcher"):
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        if info.name not in skipped and not info.name.endswith("__main__"):
            importlib.import_module(info.name)
allowed = set({TORCH_FREE_CONFIGS!r})
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "engine", "worker", "prefill_worker",
                                                             "decode_worker") and m not in allowed)
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
