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
