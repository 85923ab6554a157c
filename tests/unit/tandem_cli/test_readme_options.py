"""README's configuration table says what `tandem up --help` says: every option it names
exists, and the default it gives is the one --help shows."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from tandem_cli.up import up

README = Path(__file__).resolve().parents[3] / "README.md"


def readme_rows() -> list[tuple[str, str]]:
    """(option cell, default cell) of each row of the table under "## Configuration"."""
    section = README.read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    cells = [line.split("|")[1:3] for line in section.splitlines() if line.startswith("| `--")]
    return [(option.strip(), default.strip()) for option, default in cells]


def help_defaults() -> dict[str, str | None]:
    """Every option name --help lists (``--no-...`` too) -> the default it shows, as on/off for
    a boolean pair ("[default: no-enable-overlap]": off) and a switch (shows none: off); None
    where --help shows no default (``--redis-url``: the README says what happens instead)."""
    ctx = click.Context(up, info_name="up")
    defaults: dict[str, str | None] = {}
    for param in up.get_params(ctx):
        record = param.get_help_record(ctx)  # (names, help text): one entry of --help
        if record is None:
            continue
        names = re.findall(r"--[a-z][a-z-]*", record[0])
        shown = re.search(r"\[default: ([^\]]*)\]", record[1])
        default = shown.group(1) if shown else None
        if default is not None and names[0][2:] in (default, default.removeprefix("no-")):
            default = "off" if default.startswith("no-") else "on"
        elif default is None and getattr(param, "is_flag", False) and param.default is False:
            default = "off"
        defaults.update(dict.fromkeys(names, default))
    return defaults


def same_value(readme: str, shown: str) -> bool:
    try:
        return float(readme) == float(shown)
    except ValueError:
        return readme == shown


ROWS = readme_rows()


def test_the_table_is_found() -> None:
    assert len(ROWS) >= 20 and ROWS[0] == ("`--model`", "`SmolLM2-135M-Instruct`")


@pytest.mark.parametrize(("option", "default"), ROWS, ids=[option for option, _ in ROWS])
def test_readme_row_matches_help(option: str, default: str) -> None:
    shown = help_defaults()
    flags = re.findall(r"--[a-z][a-z-]*", option)
    assert flags and [f for f in flags if f not in shown] == []
    # "8000 / 50050" gives one default per flag; a single one belongs to the first flag
    # ("--ray [--address ADDR]": off); "0: all cores" states the value before the colon.
    values = [part.split(":")[0].replace("`", "").strip() for part in default.split(" / ")] if default else []
    assert len(values) in (0, 1, len(flags)), f"{option}: {len(flags)} flags, defaults {values}"
    for flag, value in zip(flags, values):
        if shown[flag] is not None:
            assert same_value(value, shown[flag]), f"README says {flag} defaults to {value!r}, --help {shown[flag]!r}"
