"""Compiles Tandem's small C kernels for the CPU once per machine and loads them with ctypes.

A kernel's C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``)
and ``-O3 -march=native -fopenmp`` into the Tandem cache folder, keyed by the source, the flags
and this CPU's instruction-set flags, so every machine gets code for its own ISA (AVX-512 on one,
AVX2 on another) and later starts load it in milliseconds. The kernels share torch's OpenMP
runtime (the same ``libgomp.so.1``) and are given torch's thread count by their callers.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from core.model_source import cache_dir

log = logging.getLogger(__name__)

CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")


def cpu_flags() -> str:
    """This CPU's instruction-set flags line from /proc/cpuinfo (the machine name elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return os.uname().machine


_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_bytes(source: Path) -> bytes:
    """``source``'s bytes followed by those of the local headers it includes (``#include "x.h"``,
    found beside it), so that a change to a shared header compiles its includers again.

    Raises:
        FileNotFoundError: a local header it includes is not installed.
    """
    data = source.read_bytes()
    for name in _LOCAL_INCLUDE.findall(data):
        header = source.parent / name.decode()
        if not header.is_file():
            raise FileNotFoundError(f"{source.name} includes {header}, which is not installed (package data missing)")
        data += header.read_bytes()
    return data


def library_path(source: Path) -> Path:
    """Where the compiled ``source`` for these flags and this CPU lives.

    Raises:
        FileNotFoundError: the C source is not installed (package data missing).
    """
    if not source.is_file():
        raise FileNotFoundError(f"the kernel source {source} is not installed (package data missing)")
    key = hashlib.blake2b(source_bytes(source) + " ".join(CFLAGS).encode() + cpu_flags().encode(),
                          digest_size=8).hexdigest()
    return cache_dir() / "kernels" / f"{source.stem}-{key}.so"


def compile_library(source: Path, target: Path) -> None:
    """Compiles ``source`` into the shared library ``target`` (atomically replaced).

    Raises:
        RuntimeError: no C compiler, or it failed (its first 500 characters of stderr quoted).
        subprocess.TimeoutExpired: it ran past 120 s.
    """
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise RuntimeError("no C compiler (cc or gcc; set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([compiler, *CFLAGS, str(source), "-o", str(built), "-lm"],
                                capture_output=True, text=True, timeout=120)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:500]}")
        os.replace(built, target)  # atomic: a concurrent start sees the old file or the new one


class CachedKernel:
    """One C kernel library, compiled if needed and loaded at most once per process.

    ``name`` says what it is in the logs ("CPU int8 linear kernel"), ``fallback`` what runs
    without it; ``declare`` sets the library's ctypes signatures. Thread-safe.
    """

    def __init__(self, source: Path, name: str, fallback: str, declare: Callable[[ctypes.CDLL], None],
                 release_gil: bool = False):
        self.source, self.name, self.fallback, self.declare = source, name, fallback, declare
        self.release_gil = release_gil
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None | bool = False  # False: not tried yet

    def load(self) -> ctypes.CDLL | None:
        """The library, compiling it first if needed; None (logged once) when it cannot be built
        or loaded here."""
        lib = self._lib  # once set, never changes: no lock on the hot path (a layer calls this per step)
        if lib is not False:
            return lib
        with self._lock:
            if self._lib is False:
                self._lib = self._open()
            return self._lib

    def _open(self) -> ctypes.CDLL | None:
        try:
            path = library_path(self.source)
            if not path.exists():
                started = time.perf_counter()
                log.info("compiling the %s (%s) ...", self.name, self.source.name)
                compile_library(self.source, path)
                log.info("compiled the %s in %.1f s: %s", self.name, time.perf_counter() - started, path)
            # PyDLL: calls keep the GIL, as torch's own CPU ops do. CDLL released it around every
            # call, and in a worker (gRPC and asyncio threads beside the forward) each of a pass's
            # ~250 kernel calls then let another Python thread onto a core the kernel's OpenMP
            # team was using, or made the forward wait to take the GIL back.
            # A library whose one call runs a whole pass (release_gil) lets the other threads
            # take the GIL during it: the worker's event loop then delivers the previous pass's
            # tokens while this one runs, not after it.
            lib = (ctypes.CDLL if self.release_gil else ctypes.PyDLL)(str(path))
        except (OSError, RuntimeError, subprocess.SubprocessError) as err:
            log.warning("%s unavailable (%s); %s", self.name, err, self.fallback)
            return None
        self.declare(lib)
        return lib
