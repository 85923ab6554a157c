"""Moves the router's flat modules into subpackages, as ``scripts/router_layout.txt`` lists.

Usage (from anywhere inside the checkout, on a clean tree)::

    python scripts/move_router_modules.py            # git mv + rewrite, then run the tests
    python scripts/move_router_modules.py --dry-run  # print what would change

It ``git mv``\\ s every listed file, creates each new package's ``__init__.py`` (a docstring, no
re-exports, so no new import cycles), and rewrites every reference in the tracked text files
(code, tests, docs, deploy files, the Makefile, pyproject.toml): dotted module names
(``router.placement`` -> ``router.placement.prediction``, also inside ``mock.patch`` strings and
docstrings such as ``router.placement.Predictor``) and file paths (``router/placement.py``). The
new subpackages are added to ``pyproject.toml``'s package list. Generated stubs are left alone.

It refuses to run twice (a listed destination already exists) or on a tree where a listed
source is missing, so a partial or repeated run cannot rewrite a name twice.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

LAYOUT = Path(__file__).resolve().parent / "router_layout.txt"
SELF = "scripts/move_router_modules.py"  # its docstring names old modules on purpose
TEXT_SUFFIXES = {".py", ".pyi", ".md", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg", ".ini", ".json", ".tpl"}
TEXT_NAMES = {"Makefile", "Dockerfile.cpu", "Dockerfile.gpu"}
SKIP_PARTS = ("proto/tandem/",)  # generated stubs
PACKAGE_DOCS = {
    "router/api": "The router's front-ends: OpenAI HTTP and tandem.v1.Router, request bodies, validation, ids, n > 1.",
    "router/placement": "Where a request runs: the Placer, routing policies, prediction, admission, bookkeeping, "
                        "prefix view.",
    "router/workers": "The cluster as the router sees it: live workers (registry, health) and the calls to them.",
    "router/output": "What the client gets of the tokens: the stop rule, detokenization, stop strings, logprobs.",
}


def read_layout(path: Path = LAYOUT) -> list[tuple[str, str]]:
    """(old, new) repo-relative paths; ``#`` starts a comment. Raises ValueError on a bad line."""
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not all(p.endswith(".py") for p in parts):
            raise ValueError(f"{path.name}:{number}: expected 'old.py new.py', got {line!r}")
        pairs.append((parts[0], parts[1]))
    return pairs


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def rewriter(pairs: list[tuple[str, str]]):
    """A function rewriting one text: every old module name and path to its new one, in one pass
    (so a new name is never rewritten again)."""
    dotted = {module_name(old): module_name(new) for old, new in pairs}
    slashed = {old: new for old, new in pairs}
    names = sorted(dotted, key=len, reverse=True)  # longest first: router.placement_state before router.placement
    paths = sorted(slashed, key=len, reverse=True)
    # A name counts only as a whole: not preceded by a word, dot or slash, not followed by a word
    # character (a following ".Attr" is an attribute of the old module and keeps its place).
    dotted_re = re.compile(r"(?<![\w./])(" + "|".join(map(re.escape, names)) + r")(?!\w)")
    path_re = re.compile(r"(?<![\w./])(" + "|".join(map(re.escape, paths)) + r")(?!\w)")

    def rewrite(text: str) -> str:
        text = path_re.sub(lambda m: slashed[m.group(1)], text)
        return dotted_re.sub(lambda m: dotted[m.group(1)], text)

    return rewrite


def new_packages(pairs: list[tuple[str, str]]) -> list[str]:
    """Folders the move creates (repo-relative), parents first."""
    folders = set()
    for old, new in pairs:
        parent = Path(new).parent
        while parent != Path(old).parent and parent not in (Path("."), Path("router"), Path("tests/unit/router")):
            folders.add(parent.as_posix())
            parent = parent.parent
    return sorted(folders)


def tracked_text_files(root: Path) -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=root, check=True, capture_output=True, text=True).stdout.split()
    files = []
    for name in names:
        path = root / name
        if any(part in name for part in SKIP_PARTS) or name in ("scripts/router_layout.txt", SELF):
            continue
        if (path.suffix in TEXT_SUFFIXES or path.name in TEXT_NAMES) and path.is_file():
            files.append(path)
    return files


def add_to_pyproject(text: str, packages: list[str]) -> str:
    """Adds the new router subpackages after ``"router",`` in ``[tool.setuptools] packages``."""
    dotted = [p.replace("/", ".") for p in packages if p.startswith("router/")]
    if not dotted or '"router",' not in text:
        return text
    return text.replace('"router",', '"router", ' + ", ".join(f'"{p}"' for p in dotted) + ",", 1)


def check(root: Path, pairs: list[tuple[str, str]]) -> None:
    """Raises SystemExit when a source is missing or a destination exists (a second run)."""
    missing = [old for old, _ in pairs if not (root / old).is_file()]
    present = [new for _, new in pairs if (root / new).exists()]
    if missing or present:
        raise SystemExit(f"refusing to move: missing sources {missing}, existing destinations {present} "
                         "(already moved, or the layout no longer matches the tree)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="print the moves and the files to rewrite")
    args = parser.parse_args(argv)
    root = Path(subprocess.run(["git", "rev-parse", "--show-toplevel"], check=True, capture_output=True,
                               text=True).stdout.strip())
    pairs = read_layout()
    check(root, pairs)
    rewrite = rewriter(pairs)
    changed = {p: rewrite(p.read_text()) for p in tracked_text_files(root)}
    changed = {p: text for p, text in changed.items() if text != p.read_text()}
    packages = new_packages(pairs)
    if args.dry_run:
        for old, new in pairs:
            print(f"git mv {old} {new}")
        for package in packages:
            print(f"create {package}/__init__.py")
        for path in sorted(changed):
            print(f"rewrite {path.relative_to(root)}")
        return 0
    for path, text in changed.items():  # rewrite first: the paths are still the old ones
        path.write_text(text)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(add_to_pyproject(pyproject.read_text(), packages))
    for package in packages:
        folder = root / package
        folder.mkdir(parents=True, exist_ok=True)
        init = folder / "__init__.py"
        doc = PACKAGE_DOCS.get(package)
        init.write_text(f'"""{doc}"""\n' if doc else "")
        subprocess.run(["git", "add", str(init)], cwd=root, check=True)
    for old, new in pairs:
        subprocess.run(["git", "mv", old, new], cwd=root, check=True)
    print(f"moved {len(pairs)} files into {len(packages)} new packages; rewrote {len(changed)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
