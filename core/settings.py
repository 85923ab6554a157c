"""Settings declared once: a configuration dataclass's fields carry their default and help text,
and every command line that takes them is generated from the fields.

::

    @dataclass(frozen=True)
    class PoolConfig:
        lease_ttl_s: float = setting(60.0, "Lease lifetime when a client gives none.")

    @click.command()
    @options(PoolConfig, envvar_prefix="TANDEM_POOL_")   # --lease-ttl-s [default: 60.0]
    def main(**flags):
        config = PoolConfig(**flags)

    argv(PoolConfig(lease_ttl_s=5.0))                      # ["--lease-ttl-s", "5.0"]

The option of field ``name`` is ``--name`` with dashes (``--<prefix>-name`` with a prefix, its
click parameter ``<prefix>_name``). The field's type picks the option's: ``bool`` a
``--x/--no-x`` switch (``bool | None``: None when neither is given), ``tuple[str, ...]`` a
comma-separated list, ``choices`` a :class:`click.Choice`, ``byte_size`` sizes such as ``2GiB``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import click

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "k": 1024, "kib": 1024, "m": 1024**2, "mib": 1024**2, "g": 1024**3, "gib": 1024**3, "t": 1024**4,
          "tib": 1024**4}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def setting(default: Any, help: str = "", *, choices: Sequence[str] = (), byte_size: bool = False,
            option: bool = True) -> Any:
    """A dataclass field: its one default and what its command-line option says.

    ``choices``: the values the option accepts (the dataclass still validates them);
    ``byte_size``: the option also takes sizes such as ``2GiB`` (:func:`parse_bytes`);
    ``option=False``: set by code only, never an option.
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "choices": tuple(choices), "byte_size": byte_size, "option": option})


def option_fields(cls: type, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    """The fields of dataclass ``cls`` that are command-line options, ``exclude`` left out."""
    skipped = set(exclude)
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("option", True) and f.name not in skipped]


def options(cls: type, *, prefix: str = "", exclude: Iterable[str] = (), defaults: Mapping[str, Any] | None = None,
            envvar_prefix: str = "") -> Callable:
    """A decorator adding one click option per option field of dataclass ``cls``, in field order.

    ``prefix``: options ``--<prefix>-<name>``, parameters ``<prefix>_<name>``; ``defaults``:
    a different default for some fields (a role's port); ``envvar_prefix``: each option also
    read from ``<envvar_prefix><NAME>`` (shown in --help).
    """
    hints = typing.get_type_hints(cls)
    fields = option_fields(cls, exclude)
    overrides = dict(defaults or {})

    def decorate(f: Callable) -> Callable:
        for fld in reversed(fields):
            default = overrides.get(fld.name, fld.default)
            f = _click_option(fld, hints[fld.name], prefix, default, envvar_prefix)(f)
        return f

    return decorate


def take(cls: type, params: dict[str, Any], *, prefix: str = "", exclude: Iterable[str] = ()) -> dict[str, Any]:
    """Pops the parameters :func:`options` added for ``cls`` out of ``params`` (click's
    keyword arguments); returns them by field name. Mutates ``params``."""
    found = {}
    for fld in option_fields(cls, exclude):
        key = _param_name(prefix, fld.name)
        if key in params:
            found[fld.name] = params.pop(key)
    return found


def argv(config: Any, *, names: Iterable[str] | None = None, changed_only: bool = True) -> list[str]:
    """The options that hand ``config``'s values to a process whose command is built by
    :func:`options` of the same dataclass: ``--name value`` (``--x`` / ``--no-x`` for a switch).

    ``names``: only these fields (default: every option field); ``changed_only``: skip fields at
    their default (the process has the same one). A None value (``bool | None``) is never passed.
    """
    wanted = None if names is None else set(names)
    out: list[str] = []
    for fld in option_fields(type(config)):
        if wanted is not None and fld.name not in wanted:
            continue
        value = getattr(config, fld.name)
        if value is None or (changed_only and value == fld.default):
            continue
        flag = "--" + fld.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, tuple):
            out += [flag, ",".join(value)]
        else:
            out += [flag, str(value)]
    return out


def parse_bytes(text: str) -> int:
    """Bytes of ``2GiB``, ``512MiB``, ``1.5GB``, ``64k`` or a plain number (KiB/K binary, KB decimal).

    Raises:
        ValueError: not a size.
    """
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; use bytes or a unit: 2GiB, 512MiB, 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


_SUFFIXES = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
             "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


def quantity_bytes(quantity: str | int) -> int:
    """A Kubernetes byte quantity (``16Gi``, ``500M``, ``1024``) in bytes, as the chart's
    ``tandem.bytes`` helper reads it. Raises ValueError on anything else."""
    text = str(quantity)
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)].isdigit():
            return int(text[: -len(suffix)]) * _SUFFIXES[suffix]
    if text.isdigit():
        return int(text)
    raise ValueError(f"{quantity!r} is not a byte quantity (e.g. 16Gi, 500M, 1024)")


def format_bytes(num_bytes: int) -> str:
    """``2GiB`` for 2**31, ``512MiB``, ...: the largest binary unit that divides ``num_bytes``."""
    for unit, size in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes and num_bytes % size == 0:
            return f"{num_bytes // size}{unit}"
    return str(num_bytes)


class ByteSize(click.ParamType):
    """A click option taking sizes like ``2GiB`` (see :func:`parse_bytes`)."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            return parse_bytes(value)
        except ValueError as err:
            self.fail(str(err), param, ctx)


class StrList(click.ParamType):
    """A click option taking a comma-separated list (``/health,/metrics``); blanks dropped."""

    name = "list"

    def convert(self, value, param, ctx) -> tuple[str, ...]:
        if isinstance(value, (tuple, list)):
            return tuple(value)
        return tuple(part.strip() for part in str(value).split(",") if part.strip())


def _param_name(prefix: str, name: str) -> str:
    return f"{prefix}_{name}" if prefix else name


def _plain_type(hint: Any) -> tuple[Any, bool]:
    """(the type without None, whether None was allowed) of a field's type hint."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return (args[0] if len(args) == 1 else hint), len(args) < len(typing.get_args(hint))
    return hint, False


def _click_option(fld: dataclasses.Field, hint: Any, prefix: str, default: Any, envvar_prefix: str) -> Callable:
    name = _param_name(prefix, fld.name)
    flag = "--" + name.replace("_", "-")
    # An empty default shows nothing (its help says what empty means).
    kwargs: dict[str, Any] = {"help": fld.metadata.get("help", ""), "show_default": default not in ("", ()),
                              "default": default}
    if envvar_prefix:
        kwargs.update(envvar=envvar_prefix + fld.name.upper(), show_envvar=True)
    base, _ = _plain_type(hint)
    if base is bool:
        return click.option(f"{flag}/--no-{flag[2:]}", name, **kwargs)
    if fld.metadata.get("choices"):
        kwargs["type"] = click.Choice(list(fld.metadata["choices"]))
    elif fld.metadata.get("byte_size"):
        kwargs.update(type=ByteSize(), default=format_bytes(default))  # --help shows 2GiB, not 2147483648
    elif typing.get_origin(base) is tuple:
        kwargs.update(type=StrList(), default=",".join(default))
    elif base in (int, float, str):
        kwargs["type"] = base
    elif base is Path:
        kwargs["type"] = click.Path(path_type=Path)
    else:
        raise TypeError(f"{fld.name}: no command-line option for a field of type {hint!r}")
    return click.option(flag, name, **kwargs)
