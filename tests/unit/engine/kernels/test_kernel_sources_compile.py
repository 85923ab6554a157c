"""Every C kernel source compiles wherever a C compiler works.

At run time a kernel that fails to build is logged and left out (its callers fall back to torch,
oneDNN or SDPA), and its own tests skip with it, so a compile error in one of them would pass
every other test unnoticed: a helper added to the shared ``vec_ops.h`` under a name the prefill
kernel also defined once turned the prefill attention kernel off everywhere, with 62 of its tests
skipped. Here the error fails. Besides this machine's own instruction set (``-march=native``, what
``engine.kernels.cpu_build`` compiles with), x86-64 machines also build each source for the kernels'
other vector paths: AVX2 + FMA (``x86-64-v3``), AVX-512 (``x86-64-v4``) and AVX-512 with
AVX512-BF16 and AMX (``sapphirerapids``).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from engine.kernels import cpu_build

SOURCES = sorted((Path(cpu_build.__file__).parent / "cpu").glob("*.c"))
COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
TARGETS = ("native", "x86-64-v3", "x86-64-v4", "sapphirerapids")


def test_every_kernel_source_is_found():
    assert {p.name for p in SOURCES} >= {"paged_decode_attention.c", "paged_prefill_attention.c", "elementwise.c",
                                         "fp32_linear.c", "int8_linear.c"}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_source_compiles(source: Path, target: str, tmp_path: Path):
    if COMPILER is None:
        pytest.skip("no C compiler here (cc or gcc; set CC)")
    if target != "native" and platform.machine() != "x86_64":
        pytest.skip(f"-march={target} is an x86-64 target")
    flags = [f"-march={target}" if flag.startswith("-march=") else flag for flag in cpu_build.CFLAGS]
    result = subprocess.run([COMPILER, *flags, "-Werror=implicit-function-declaration", str(source), "-o",
                             str(tmp_path / "kernel.so"), "-lm"], capture_output=True, text=True, timeout=120)
    unknown_target = ("bad value" in result.stderr and "march" in result.stderr) or "unknown target CPU" in result.stderr
    if result.returncode != 0 and target != "native" and unknown_target:  # GCC's words, then Clang's
        pytest.skip(f"this compiler does not know -march={target}")
    assert result.returncode == 0, result.stderr[-3000:]
