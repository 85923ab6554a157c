"""Child processes of a launcher (the local one, or a Ray actor hosting one service): each
started with its output in a log file and tied to its parent's life, so no service outlives
the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child before exec: SIGTERM when the parent dies (PR_SET_PDEATHSIG). Note that the
    kernel tracks the parent *thread*: a child forked from a thread that ends gets SIGTERM too."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: Ctrl-C still stops everything through the launcher's stop()
        pass


def spawn(argv: list[str], env: dict[str, str], log_path: Path, note: str = "") -> subprocess.Popen:
    """Starts ``argv`` in a session of its own with ``env`` added to this environment, stdout and
    stderr to ``log_path``: truncated, or with ``note`` appended to it (a restart keeps the
    previous process's log). The child gets SIGTERM when the calling thread's process dies."""
    with open(log_path, "ab" if note else "wb") as log_file:
        log_file.write(note.encode())
        log_file.flush()
        return subprocess.Popen(
            argv, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=die_with_parent, env={**os.environ, **env},
        )


def stop(process: subprocess.Popen, timeout_s: float) -> int:
    """SIGTERM (unless it already exited), SIGKILL after ``timeout_s``; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return process.returncode
