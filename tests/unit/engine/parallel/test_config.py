"""EngineConfig's tensor-parallel size: bad values refused with the value quoted."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig


def test_zero_ranks_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_overlap_with_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="enable_overlap needs tensor_parallel_size 1, got 2"):
        EngineConfig(tensor_parallel_size=2, enable_overlap=True)
    assert EngineConfig(tensor_parallel_size=1, enable_overlap=True).enable_overlap
