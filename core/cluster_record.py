"""Which clusters ``tandem up`` is running on this machine for this user, so that ``tandem status``
without ``--url`` finds the one you started (not whatever answers on port 8000).

Each running ``tandem up`` keeps one JSON file, ``<cache>/clusters/<pid>.json`` (core.model_source
cache_dir: ``~/.cache/tandem``), holding its routers' URLs; it removes the file when it stops. A
file whose process is gone (killed with SIGKILL) is ignored and removed by the next reader.
:func:`choose_url` picks the router a command without ``--url`` talks to (``tandem status``,
``tandem bench``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import click

from core.model_source import cache_dir

DEFAULT_URL = "http://127.0.0.1:8000"  # a router on its default port


@dataclass(frozen=True)
class ClusterRecord:
    pid: int
    urls: tuple[str, ...]  # each router's base URL (http://host:port)
    log_dir: str
    started: float  # time.time()


def records_dir() -> Path:
    return cache_dir() / "clusters"


def write(urls: list[str], log_dir: Path, folder: Path | None = None) -> Path:
    """Records this process's cluster; returns the file (for :func:`remove`)."""
    folder = folder or records_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}.json"
    path.write_text(json.dumps({"pid": os.getpid(), "urls": list(urls), "log_dir": str(log_dir),
                                "started": time.time()}))
    return path


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def running(folder: Path | None = None) -> list[ClusterRecord]:
    """The clusters whose ``tandem up`` still runs, oldest first (stale files are removed)."""
    folder = folder or records_dir()
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            data = json.loads(path.read_text())
            record = ClusterRecord(int(data["pid"]), tuple(data["urls"]), data.get("log_dir", ""),
                                   float(data.get("started", 0)))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if _alive(record.pid):
            out.append(record)
        else:
            path.unlink(missing_ok=True)
    return sorted(out, key=lambda r: r.started)


def with_scheme(url: str) -> str:
    """``127.0.0.1:8000`` -> ``http://127.0.0.1:8000``; a URL with a scheme is kept."""
    return url if "://" in url else f"http://{url}"


def choose_url(url: str | None, records: list) -> tuple[str, str]:
    """(router URL, why that one): ``url`` when given; else the router of the one cluster
    ``tandem up`` runs on this machine (:func:`running`); else the default port.

    Raises:
        click.UsageError: several clusters run and no ``url`` says which.
    """
    if url:
        return with_scheme(url), ""
    if len(records) == 1:
        return records[0].urls[0], f"the cluster tandem up (pid {records[0].pid}) runs"
    if records:
        listed = "; ".join(f"pid {r.pid}: {' '.join(r.urls)}" for r in records)
        raise click.UsageError(f"{len(records)} clusters started by tandem up run here ({listed}); pass --url")
    return DEFAULT_URL, "no cluster started by tandem up is recorded here: the default port"
