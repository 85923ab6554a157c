"""Fixtures of the `tandem` CLI tests."""

from __future__ import annotations

import pytest

from core import cluster_record


@pytest.fixture(autouse=True)
def own_cluster_records(tmp_path_factory, monkeypatch) -> None:
    """A `tandem up` these tests run (over a fake cluster) records it here, not where `tandem status`
    and `tandem bench` on this machine look for the clusters that really run."""
    folder = tmp_path_factory.mktemp("clusters")
    monkeypatch.setattr(cluster_record, "records_dir", lambda: folder)
