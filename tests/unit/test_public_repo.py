"""The repository stands alone and speaks as a public project: no absolute path of a particular
machine, no path into a folder beside the clone, and nothing about how the work was organised.
Every tracked text file is read (this file's own patterns excepted)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "an absolute path of a particular machine": r"(?<![\w.])/(work|root)/|/home/(?!tandem\b)\w+",
    "a folder beside the clone": r"\.\./shared\b|\bshared/(data|DESIGN)|\bin the (project )?workspace\b",
    "an issue or ticket number": r"\bissues? #?\d+\b",
    "how the work was organised": (
        r"\b(other|another|later|earlier|previous|first|second|third|fourth|five|four|three) sessions?\b"
        r"|\bsessions?'s?\b (hot-path|load)|\bthe lead\b|\b(was|were) (lent|handed out)\b|\bno GPU was\b"
        r"|\bworktrees?\b|\bother developers\b|\bquiet lock\b|\btandem-quiet\b|\bthe brief\b|\bhelpers? (session|engineer)s?\b"),
}


def tracked_text_files() -> list[Path]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no list of tracked files")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return [f for f in files if f.is_file() and f != Path(__file__).resolve() and b"\0" not in f.read_bytes()[:8192]]


def findings(text: str) -> list[str]:
    """``what: matched text`` for every forbidden pattern found in ``text``."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in FORBIDDEN.items()
            for m in re.finditer(pattern, text, flags=re.IGNORECASE)]


def test_the_patterns_catch_what_they_are_for() -> None:
    text = ("read /work/shared/data/x.json or ../shared/data; see issue 13; a later session on the box; "
            "no GPU was lent; in a worktree of main; the third session's hot-path changes")
    assert findings(text) == [
        "an absolute path of a particular machine: '/work/'", "a folder beside the clone: 'shared/data'",
        "a folder beside the clone: '../shared'", "an issue or ticket number: 'issue 13'",
        "how the work was organised: 'later session'", "how the work was organised: 'no GPU was'",
        "how the work was organised: 'worktree'", "how the work was organised: 'third session'"]
    assert findings("USER tandem, WORKDIR /home/tandem; 135 sessions; BurstGPT's Session ID; "
                    "pytest's scope='session'; the chart's tandem.bytes helper") == []


def test_no_tracked_file_names_a_machine_path_or_how_the_work_was_organised() -> None:
    files = tracked_text_files()
    assert len(files) > 200  # the whole tree was read
    found = [f"{path.relative_to(ROOT)}: {hit}" for path in files
             for hit in findings(path.read_text(errors="replace"))]
    assert found == []


@pytest.mark.parametrize("doc", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_the_readme_links_every_doc(doc: Path) -> None:
    assert f"(docs/{doc.name}" in (ROOT / "README.md").read_text()
