"""core.registry.WorkerInfo: entries of older and newer workers both parse."""

from __future__ import annotations

import json

import pytest

from core.registry import WorkerInfo


def test_worker_info_json_is_backward_and_forward_compatible():
    old = WorkerInfo.from_json('{"worker_id": "w", "role": "decode", "address": "a:1", "load": {}}')
    assert (old.spec_fingerprint, old.block_size) == ("", 0)
    new = WorkerInfo.from_json(json.dumps({"worker_id": "w", "role": "prefill", "address": "a:1",
                                           "spec_fingerprint": "ab", "block_size": 16, "from_the_future": 1}))
    assert (new.spec_fingerprint, new.block_size) == ("ab", 16)
    with pytest.raises(ValueError, match="bad worker entry"):
        WorkerInfo.from_json('{"role": "decode"}')
    with pytest.raises(ValueError, match="not a JSON object"):
        WorkerInfo.from_json("[1]")


def test_a_pool_entry_carries_its_stats_and_bad_stats_are_refused():
    entry = WorkerInfo("pool-0", "pool", "a:1", pool_stats={"capacity_bytes": 1024, "num_leases": 2})
    back = WorkerInfo.from_json(entry.to_json())
    assert back.pool_stats == {"capacity_bytes": 1024, "num_leases": 2} and back.role == "pool"
    assert WorkerInfo.from_json('{"worker_id": "w", "role": "decode", "address": "a:1"}').pool_stats == {}
    with pytest.raises(ValueError, match="pool_stats of 'p' must map names to numbers"):
        WorkerInfo("p", "pool", "a:1", pool_stats={"capacity_bytes": "lots"})
    with pytest.raises(ValueError, match=r"pool_stats of 'p' must map names to numbers, got \[1\]"):
        WorkerInfo.from_json('{"worker_id": "p", "role": "pool", "address": "a:1", "pool_stats": [1]}')
