"""What ``pip install .`` (and so every image, deploy/docker) puts next to the Python modules: the
files the packages read at run time must match a ``[tool.setuptools.package-data]`` pattern of
pyproject.toml, or an installed worker lacks them (an image without the C attention kernel's
source once crash-looped on Kubernetes).

The patterns are matched as setuptools matches them: globs relative to the package's folder."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]

# Files the installed packages read at run time, by package.
RUNTIME_DATA = {
    # compiled on first use (cpu_decode_attention, ...), with the local headers they include
    "engine.kernels": ["cpu/paged_decode_attention.c", "cpu/elementwise.c", "cpu/vec_exp.h"],
    "router.chat_templates": ["hermes.jinja"],  # importlib.resources (router.chat_templates)
}
# Non-Python files inside package folders that are not read at run time.
NOT_RUNTIME = {
    "tandem.v1": ("*.proto", "*.pyi"),  # the protobuf sources and type stubs of the generated modules
    "chaos": ("campaigns/*.yaml",),  # example campaigns, given to `tandem chaos` by path
}


def package_folder(package: str) -> Path:
    top, *rest = package.split(".")
    return ROOT / SETUPTOOLS.get("package-dir", {}).get(top, top) / Path(*rest)


def packaged(package: str) -> set[Path]:
    """The files the package-data patterns of ``package`` select (relative to its folder)."""
    folder = package_folder(package)
    patterns = SETUPTOOLS.get("package-data", {}).get(package, [])
    return {path.relative_to(folder) for pattern in patterns for path in folder.glob(pattern) if path.is_file()}


@pytest.mark.parametrize("package", sorted(RUNTIME_DATA))
def test_the_runtime_data_files_are_package_data(package: str) -> None:
    assert package in SETUPTOOLS["packages"]
    for name in RUNTIME_DATA[package]:
        assert (package_folder(package) / name).is_file(), f"{package}: {name} is not in the repository"
    assert {Path(name) for name in RUNTIME_DATA[package]} <= packaged(package)


def test_the_kernel_source_is_where_the_module_reads_it() -> None:
    from engine.kernels import cpu_decode_attention

    assert cpu_decode_attention.SOURCE.relative_to(package_folder("engine.kernels")) in packaged("engine.kernels")


def test_every_tracked_non_python_file_in_a_package_is_packaged_or_known() -> None:
    """A data file added to a package folder later needs a package-data pattern (or a reason here)."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    files = {ROOT / name for name in tracked.split("\0") if name and not name.endswith(".py")}
    packages = set(SETUPTOOLS["packages"])
    unpackaged = []
    for package in sorted(packages):
        folder = package_folder(package)
        selected = packaged(package)
        for path in sorted(f for f in files if folder in f.parents):
            rel = path.relative_to(folder)
            if len(rel.parts) > 1 and f"{package}.{rel.parts[0]}" in packages:
                continue  # the subpackage's own
            if rel in selected or any(rel.match(p) for p in NOT_RUNTIME.get(package, ())):
                continue
            unpackaged.append(f"{package}: {rel}")
    assert unpackaged == []


def test_the_wheel_holds_the_runtime_data_and_setuptools_does_not_warn(tmp_path: Path) -> None:
    """Built as ``pip install .`` builds it: the data files are in the wheel, and setuptools says
    nothing about a data folder missing from ``packages`` (``make demo`` once printed it)."""
    pytest.importorskip("setuptools")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path)], capture_output=True, text=True, check=False)
    assert build.returncode == 0, build.stderr
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for package, files in RUNTIME_DATA.items():
        assert {f"{package_folder(package).relative_to(ROOT)}/{name}" for name in files} <= names
