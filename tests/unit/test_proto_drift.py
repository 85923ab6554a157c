"""The committed stubs are exactly what the .proto sources generate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_match_proto_sources(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools not installed (pip install -e '.[dev]')")
    spec = importlib.util.spec_from_file_location("protogen", ROOT / "proto" / "generate.py")
    protogen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(protogen)
    fresh = {p.name: p.read_bytes() for p in protogen.generate(tmp_path)}
    committed_dir = ROOT / "proto" / "tandem" / "v1"
    committed = {p.name: p.read_bytes() for p in committed_dir.glob("*_pb2*.py*")}
    assert sorted(fresh) == sorted(committed), "stub files differ: run `make protos` and commit"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make protos` and commit"
