"""Compiles Tandem's small C kernels for the CPU once per machine and loads them with ctypes.

A kernel's C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``)
and ``-O3 -march=native -fopenmp`` into the Tandem cache folder, keyed by the source, the flags
and this CPU's instruction-set flags, so every machine gets code for its own ISA (AVX-512 on one,
AVX2 on another) and later starts load it in milliseconds. The kernels share torch's OpenMP
runtime (the same ``libgomp.so.1``) and are given torch's thread count by their callers.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from core.model_source import cache_dir

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


def library_path(source: Path) -> Path:
    """Where the compiled ``source`` for these flags and this CPU lives.

    Raises:
        FileNotFoundError: the C source is not installed (package data missing).
    """
    if not source.is_file():
        raise FileNotFoundError(f"the kernel source {source} is not installed (package data missing)")
    key = hashlib.blake2b(source.read_bytes() + " ".join(CFLAGS).encode() + cpu_flags().encode(),
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
