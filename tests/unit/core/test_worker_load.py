"""core.worker_load.WorkerLoad: the heartbeat wire format, its version, the GetStats reply; the one FinishReason map."""

from __future__ import annotations

import json

import pytest

from core.cost_model import CostModel
from core.proto_convert import finish_reason_from_proto, finish_reason_to_proto, worker_stats_to_proto
from core.registry import NO_LOAD, WorkerInfo
from core.request import FinishReason
from core.worker_load import LOAD_VERSION, WorkerLoad
from tandem.v1 import common_pb2

COST = CostModel(0.001, 2e-5, 3e-4, 4e-7, num_samples=37, max_num_batched_tokens=256,
                 kv_load_bytes_per_s=1.5e9, kv_bytes_per_token=18432.0)
LOAD = WorkerLoad(num_requests_running=3, num_requests_waiting=2, num_total_blocks=64, num_used_blocks=10,
                  num_free_blocks=54, num_preemptions=1, num_batched_tokens=128, num_waiting_tokens=900,
                  num_kv_tokens=300, recent_step_time_s=0.0125, max_num_seqs=16, cost_model=COST)
# The version-1 layout: what workers wrote before the version existed (worker.stats.worker_load).
V1_KEYS = {
    "num_requests_running", "num_requests_waiting", "num_total_blocks", "num_used_blocks", "num_free_blocks",
    "num_preemptions", "num_batched_tokens", "num_waiting_tokens", "num_kv_tokens", "recent_step_time_s",
    "max_num_seqs", "cost_base_s", "cost_per_token_s", "cost_per_seq_s", "cost_per_attn_s", "cost_num_samples",
    "cost_max_num_batched_tokens", "cost_kv_load_bytes_per_s", "cost_kv_bytes_per_token",
}


def test_wire_round_trip_keeps_the_version_1_layout():
    wire = json.loads(json.dumps(LOAD.to_wire()))  # through Redis
    assert set(wire) == V1_KEYS
    assert (wire["num_free_blocks"], wire["cost_num_samples"], wire["cost_max_num_batched_tokens"]) == (54, 37.0, 256.0)
    parsed = WorkerLoad.from_wire(wire)
    assert parsed == LOAD
    assert isinstance(parsed.num_kv_tokens, int) and isinstance(parsed.cost_model.num_samples, int)
    assert (parsed.num_requests, parsed.fitted_cost_model) == (5, COST)


def test_missing_keys_are_an_older_worker_and_unknown_ones_a_newer():
    old = WorkerLoad.from_wire({"num_requests_running": 3})
    assert (old.num_requests_running, old.num_free_blocks, old.max_num_seqs) == (3, None, None)
    assert old.fitted_cost_model is None and old.cost_model.max_num_batched_tokens == 2048
    assert WorkerLoad.from_wire({**LOAD.to_wire(), "num_from_the_future": 1.0}) == LOAD
    unfitted = WorkerLoad(cost_model=CostModel(max_num_batched_tokens=128))
    assert WorkerLoad.from_wire(unfitted.to_wire()).fitted_cost_model is None  # nothing measured yet


def test_another_version_or_a_bad_value_fails_clearly():
    with pytest.raises(ValueError, match="load version 2 is not the 1 this build reads: run the router and the "
                                         "workers from the same release"):
        WorkerLoad.from_wire(LOAD.to_wire(), version=2)
    with pytest.raises(ValueError, match="bad worker load .* 'many' is not a number"):
        WorkerLoad.from_wire({"num_requests_running": "many"})
    with pytest.raises(ValueError, match="not a JSON object"):
        WorkerLoad.from_wire([1, 2])


def test_registry_entry_carries_the_version_and_refuses_another():
    info = WorkerInfo("d1", "decode", "a:1", LOAD, heartbeat_time_s=5.0, spec_fingerprint="fp", block_size=16)
    entry = json.loads(info.to_json())
    assert entry["load_version"] == LOAD_VERSION and set(entry["load"]) == V1_KEYS
    assert WorkerInfo.from_json(info.to_json()) == info
    del entry["load_version"]  # a worker from before the version: the same layout
    assert WorkerInfo.from_json(json.dumps(entry)).load == LOAD
    entry["load_version"] = 2
    with pytest.raises(ValueError, match="bad worker entry of 'd1': load version 2"):
        WorkerInfo.from_json(json.dumps(entry))
    pool = WorkerInfo("pool-1", "pool", "a:2")
    assert json.loads(pool.to_json())["load"] == {} and WorkerInfo.from_json(pool.to_json()).load == NO_LOAD


def test_get_stats_reply_is_the_load_field_by_field():
    reply = worker_stats_to_proto(LOAD, num_prefill_tokens=500, num_cached_tokens=64, num_generated_tokens=40)
    assert (reply.num_requests_running, reply.num_free_blocks, reply.max_num_seqs) == (3, 54, 16)
    assert (reply.num_batched_tokens, reply.num_waiting_tokens, reply.num_kv_tokens) == (128, 900, 300)
    assert (reply.num_prefill_tokens, reply.num_cached_tokens, reply.num_generated_tokens) == (500, 64, 40)
    assert reply.recent_step_time_s == 0.0125
    assert (reply.cost_base_s, reply.cost_per_attn_s, reply.cost_num_samples) == (0.001, 4e-7, 37)
    assert (reply.cost_max_num_batched_tokens, reply.cost_kv_load_bytes_per_s) == (256, 1.5e9)
    assert worker_stats_to_proto(WorkerLoad(), 0, 0, 0).num_free_blocks == 0  # not reported: 0 on the wire


def test_one_finish_reason_map_both_ways():
    for reason in FinishReason:
        assert finish_reason_from_proto(finish_reason_to_proto(reason)) is reason
    assert finish_reason_to_proto(FinishReason.LENGTH) == common_pb2.FINISH_REASON_LENGTH
    assert finish_reason_from_proto(common_pb2.FINISH_REASON_UNSPECIFIED) is FinishReason.ABORT
    assert finish_reason_from_proto(99) is FinishReason.ABORT  # a reason from a newer worker
