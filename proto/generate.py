"""Regenerates the committed Python stubs from the ``.proto`` sources.

Usage: ``python proto/generate.py [OUT_DIR]``. Without OUT_DIR the stubs are written next to
their sources (``proto/tandem/v1``); the drift test writes them to a temporary folder and
compares byte for byte.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / "tandem" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Runs protoc (from grpcio-tools) over every source; returns the files written.

    Raises RuntimeError with protoc's exit code when generation fails.
    """
    from grpc_tools import protoc  # dev dependency: only needed to regenerate

    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p) for p in PROTO_FILES],
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code}")
    return sorted((out_dir / "tandem" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_ROOT
    for path in generate(target):
        print(path)
