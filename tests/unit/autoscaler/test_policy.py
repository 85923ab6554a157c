"""The autoscaler's decisions from hand-built heartbeats: pressure, hysteresis, bounds, cooldown."""

from __future__ import annotations

import pytest

from autoscaler.policy import Autoscaler, AutoscaleConfig, decode_pressure, prefill_pressure, role_pressure
from dataclasses import replace

from core.cost_model import CostModel
from core.worker_load import WorkerLoad

COST = CostModel(base_s=0.01, per_token_s=0.001, num_samples=8, max_num_batched_tokens=1000)
IDLE = WorkerLoad()  # a heartbeat with nothing in it (no cost model yet)


def decode_load(used_blocks: int, step_s: float = 0.01, running: int = 1, waiting: int = 0) -> WorkerLoad:
    return WorkerLoad(num_total_blocks=100, num_used_blocks=used_blocks, recent_step_time_s=step_s,
                      num_requests_running=running, num_requests_waiting=waiting, max_num_seqs=64)


CONFIG = AutoscaleConfig(ttft_slo_s=1.0, tbt_slo_s=0.1, min_prefill=1, max_prefill=3, min_decode=1, max_decode=3,
                         up_evaluations=2, down_evaluations=3, cooldown_s=10.0, kv_usage_high=0.9)


def test_pressures_are_the_slo_ratios():
    # 2000 queued tokens = 2 chunks of 1000: 2 x 10 ms + 2000 x 1 ms = 2.02 s against a 1 s SLO.
    queued = WorkerLoad(num_waiting_tokens=1500, num_batched_tokens=500, cost_model=COST)
    assert prefill_pressure(queued, CONFIG) == pytest.approx(2.02)
    assert prefill_pressure(WorkerLoad(num_waiting_tokens=1500), CONFIG) == 0.0  # no cost model yet
    assert decode_pressure(decode_load(45), CONFIG) == pytest.approx(0.5)  # 45 % of blocks / 0.9
    assert decode_pressure(decode_load(10, step_s=0.15), CONFIG) == pytest.approx(1.5)  # TBT 150 ms / 100 ms
    assert decode_pressure(decode_load(10, running=2, waiting=1), CONFIG) == pytest.approx(0.111, abs=1e-3)  # a snapshot's queue
    # 1500 prompt tokens: 1.52 s of prefill
    colocated = replace(decode_load(10), cost_model=COST, num_waiting_tokens=1500)
    assert decode_pressure(colocated, CONFIG) == pytest.approx(1.52)
    # (90 % / 0.9 = 1.0, and the idle one's 10 ms step / 100 ms = 0.1): their mean
    assert role_pressure("decode", [decode_load(90), decode_load(0)], CONFIG) == pytest.approx(0.55)


def test_scales_decode_up_after_two_hot_evaluations_then_respects_the_cooldown():
    scaler = Autoscaler(CONFIG)
    hot = {"prefill": [IDLE], "decode": [decode_load(99)]}
    assert scaler.evaluate(0.0, hot, {"prefill": 1, "decode": 1})["decode"] == 1  # once is not enough
    assert scaler.evaluate(1.0, hot, {"prefill": 1, "decode": 1})["decode"] == 2
    both_hot = {"prefill": [IDLE], "decode": [decode_load(99), decode_load(99)]}
    for t in (2.0, 3.0, 4.0):  # within the cooldown: no second step
        assert scaler.evaluate(t, both_hot, {"prefill": 1, "decode": 2})["decode"] == 2
    assert scaler.evaluate(11.0, both_hot, {"prefill": 1, "decode": 2})["decode"] == 3
    assert scaler.evaluate(30.0, {"decode": [decode_load(99)] * 3}, {"prefill": 1, "decode": 3})["decode"] == 3  # max


def test_scales_down_only_when_one_worker_fewer_would_stay_cool():
    scaler = Autoscaler(CONFIG)
    # Two workers at 45 % blocks: pressure 0.5; on one worker it would be 1.0 > 0.5: stay.
    warm = {"decode": [decode_load(45), decode_load(45)]}
    for t in range(5):
        assert scaler.evaluate(float(t), warm, {"prefill": 1, "decode": 2})["decode"] == 2
    cool = {"decode": [decode_load(9), decode_load(9)]}  # 0.11 -> 0.22 on one worker
    results = [scaler.evaluate(10.0 + t, cool, {"prefill": 1, "decode": 2})["decode"] for t in range(3)]
    assert results == [2, 2, 1]  # three cool evaluations in a row
    assert scaler.evaluate(20.0, {"decode": [decode_load(0)]}, {"prefill": 1, "decode": 1})["decode"] == 1  # min


def test_an_idle_worker_whose_last_passes_were_slow_lets_the_role_scale_down():
    # Load ended: no request runs, no block is used, but the mean of the last passes is still
    # the loaded one (150 ms against a 100 ms SLO).
    after_load = decode_load(0, step_s=0.15, running=0)
    assert decode_pressure(after_load, CONFIG) == 0.0
    assert decode_pressure(decode_load(0, step_s=0.15, running=1), CONFIG) == pytest.approx(1.5)
    scaler = Autoscaler(CONFIG)
    idle = {"decode": [after_load, after_load]}
    results = [scaler.evaluate(float(t), idle, {"prefill": 1, "decode": 2})["decode"] for t in range(3)]
    assert results == [2, 2, 1]


def test_a_starting_worker_holds_decisions_and_bounds_apply_at_once():
    scaler = Autoscaler(CONFIG)
    hot_one = {"decode": [decode_load(99)]}  # 2 asked for, only 1 heartbeats yet
    assert [scaler.evaluate(float(t), hot_one, {"prefill": 1, "decode": 2})["decode"] for t in range(4)] == [2] * 4
    assert scaler.evaluate(0.0, {}, {"prefill": 0, "decode": 5}) == {"prefill": 1, "decode": 3}


def test_colocated_keeps_no_prefill_workers_and_bad_configs_are_refused():
    colocated = AutoscaleConfig(min_prefill=0, max_prefill=0)
    assert Autoscaler(colocated).evaluate(0.0, {"decode": [decode_load(0)]}, {"prefill": 0, "decode": 1})["prefill"] == 0
    with pytest.raises(ValueError, match="scale_down_pressure"):
        AutoscaleConfig(scale_down_pressure=1.2)
    with pytest.raises(ValueError, match="prefill bounds"):
        AutoscaleConfig(min_prefill=3, max_prefill=2)
    with pytest.raises(ValueError, match="min_decode"):
        AutoscaleConfig(min_decode=0)
