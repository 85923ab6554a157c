"""The simulator from ints: hand-checkable timelines on the real Scheduler and router."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from core.cost_model import CostModel
from core.worker_load import WorkerLoad
from engine.config import EngineConfig
from engine.scheduler import Scheduler
from router.placement.admission import Admission
from router.placement.state import PlacementBook
from router.placement.placer import Placer
from router.placement.prediction import SLO
from router.placement.policies import PredictedLatencyPolicy, RoundRobinPolicy
from sim import adapter
from sim.cluster import ClusterSpec, CoreSharing, RouterSpec, fitted_worker
from sim.simulator import Simulation
from sim.workload import SimRequest, load_trace

DATA = Path(__file__).parents[2] / "data"
# step_s = 10 ms + 1 ms per computed token: every step below is checkable by hand.
COST = CostModel(base_s=0.010, per_token_s=0.001, num_samples=1, max_num_batched_tokens=64,
                 kv_load_bytes_per_s=100_000.0, kv_bytes_per_token=100.0)  # KV: 1 ms per token
ENGINE = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64)


def cluster(num_prefill: int, num_decode: int, policy: str = "round_robin", sharing: CoreSharing | None = None,
            **router) -> ClusterSpec:
    worker = fitted_worker(COST, ENGINE, COST.kv_bytes_per_token)
    return ClusterSpec(num_prefill, num_decode, worker, worker, router=RouterSpec(policy, **router), sharing=sharing)


def assert_idle(sim: Simulation) -> None:
    for w in (*sim.prefill, *sim.decode):
        assert w.engine.num_unfinished == 0 and w.engine.num_used_blocks == 0


def test_two_requests_colocated_timeline():
    # A: 8 prompt tokens, 3 outputs, at 0; B: 4 prompt tokens, 2 outputs, at 15 ms (during A's prefill).
    # step 1 [0, 18 ms): A's prefill (8 tokens)            -> A token 1 at 18 ms
    # step 2 [18, 33 ms): A decodes (1) + B prefills (4)  -> A token 2, B token 1 at 33 ms
    # step 3 [33, 45 ms): A (1) + B (1)                   -> A token 3, B token 2 at 45 ms: both end
    sim = Simulation(cluster(0, 1))
    result = sim.run([SimRequest(list(range(1, 9)), 3, 0.0), SimRequest([100, 101, 102, 103], 2, 0.015)])
    a, b = result.records
    assert a.ttft_s == pytest.approx(0.018) and b.ttft_s == pytest.approx(0.018)
    assert a.chunk_times_s == pytest.approx([0.018, 0.033, 0.045])
    assert b.chunk_times_s == pytest.approx([0.018, 0.030])
    assert (a.e2e_s, b.e2e_s) == pytest.approx((0.045, 0.030))
    assert (a.output_tokens, b.output_tokens) == (3, 2)
    assert result.duration_s == pytest.approx(0.045)
    assert result.workers[0]["busy_s"] == pytest.approx(0.045) and result.workers[0]["num_steps"] == 3
    assert_idle(sim)


def test_disaggregated_timeline_with_kv_transfers():
    # prefill: pool empty (no load), 8 tokens 18 ms, store 8 tokens' KV 8 ms -> TTFT 26 ms;
    # decode: load 8 tokens 8 ms (34 ms), one step of 1 token 11 ms -> token 2 at 45 ms.
    sim = Simulation(cluster(1, 1, disaggregation="always"))
    result = sim.run([SimRequest(list(range(1, 9)), 2, 0.0)])
    (record,) = result.records
    assert record.ttft_s == pytest.approx(0.026)
    assert record.chunk_times_s == pytest.approx([0.026, 0.045])
    assert len(sim.pool) == 2  # the prompt's two full blocks, content-addressed
    assert_idle(sim)


def test_second_request_loads_the_shared_prefix_from_the_pool():
    # Same 8-token prompt again after the first ended: the pool gives 7 tokens' worth rounded down
    # to one 4-token block (loaded in 4 ms); the prefill worker's own prefix cache still holds both
    # blocks, so its Scheduler computes only the last token (11 ms); the 4 tokens not from the pool
    # are stored (4 ms): TTFT 19 ms.
    sim = Simulation(cluster(1, 1, disaggregation="always"))
    result = sim.run([SimRequest(list(range(1, 9)), 1, 0.0), SimRequest(list(range(1, 9)), 1, 1.0)])
    first, second = result.records
    assert first.ttft_s == pytest.approx(0.026) and second.ttft_s == pytest.approx(0.019)
    assert result.pool_hit_rate == pytest.approx(2 / 4)  # 4 blocks queried, 2 found (the second request's)
    assert_idle(sim)


def test_the_simulator_runs_the_real_scheduler_and_router_classes():
    assert adapter.REAL_CLASSES == {"Scheduler": Scheduler, "Placer": Placer, "Admission": Admission,
                                    "PlacementBook": PlacementBook}
    assert all(getattr(adapter, name) is cls for name, cls in adapter.REAL_CLASSES.items())
    sim = Simulation(cluster(1, 2, policy="predicted_latency"))
    assert type(sim.decode[0].engine.scheduler) is Scheduler
    placer = sim.router.placer
    assert type(placer) is Placer and type(placer.policy) is PredictedLatencyPolicy
    assert type(placer.book) is PlacementBook and placer.policy.view.reads(placer.book)
    assert type(placer.admission) is Admission
    sim.run([SimRequest(list(range(1, 9)), 2, 0.0)])
    assert type(sim.decode[0].info.load) is WorkerLoad  # the heartbeat the policy read
    assert sim.decode[0].info.load.cost_model == COST
    assert type(Simulation(cluster(0, 1)).router.placer.policy) is RoundRobinPolicy
    probe = "import sys, sim.simulator, sim.cli; assert 'torch' not in sys.modules, 'sim imports torch'"
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=Path(__file__).parents[3])


@pytest.mark.parametrize("shared", [False, True], ids=["own-devices", "shared-cores"])
@pytest.mark.parametrize("num_prefill", [0, 1])
def test_bulk_decode_runs_give_the_step_by_step_timeline(num_prefill, shared):
    timelines, events = [], []
    sharing = CoreSharing(num_cores=2, prefill_threads=1, decode_threads=1) if shared else None
    for decode_runs in (False, True):
        requests = load_trace(DATA / "mooncake_conversation_slice.jsonl", "mooncake", time_scale=0.01)
        requests = [SimRequest(r.prompt[: 30 + i], 6 + 3 * i, r.arrival_s) for i, r in enumerate(requests)]
        sim = Simulation(cluster(num_prefill, 2, policy="predicted_latency", sharing=sharing), decode_runs=decode_runs)
        result = sim.run(requests)
        timelines.append([r.chunk_times_s for r in result.records])
        events.append(result.num_events)
        assert_idle(sim)
    assert [len(t) for t in timelines[0]] == [6 + 3 * i for i in range(len(timelines[0]))]
    for slow, fast in zip(*timelines):
        assert fast == pytest.approx(slow, abs=1e-9)
    assert events[1] < events[0]  # runs were taken


def test_a_request_longer_than_max_model_len_is_refused_with_400():
    sim = Simulation(cluster(0, 1))
    result = sim.run([SimRequest([1] * 60, 5, 0.0), SimRequest([2] * 8, 2, 0.0)])
    assert [r.error_kind for r in result.records] == ["http_400", ""]
    assert result.records[1].output_tokens == 2
    assert_idle(sim)


def test_admission_refuses_what_cannot_meet_the_router_slo():
    # A 1 ms TTFT SLO nobody meets; the first request is admitted (no queue), the burst behind it is
    # refused with 429 once the queue ahead exceeds max_queue_s.
    sim = Simulation(cluster(0, 1, policy="predicted_latency", slo=SLO(ttft_s=0.001), max_queue_s=0.05))
    requests = [SimRequest([7] * 60, 2, 0.0) for _ in range(6)]
    result = sim.run(requests)
    kinds = [r.error_kind for r in result.records]
    assert kinds[0] == "" and "http_429" in kinds
    assert all(r.ttft_s is None for r in result.records if r.error_kind)
    assert_idle(sim)


def test_the_router_overhead_delays_every_request_before_it_reaches_a_worker():
    # As test_two_requests_colocated_timeline, but each request reaches the worker 5 ms after it
    # arrived: A's prefill [5, 23 ms); B (arrived 15, at the worker 20) joins A's decode in
    # [23, 38 ms) and ends in [38, 50 ms): B's tokens 23 and 35 ms after it arrived.
    sim = Simulation(cluster(0, 1, request_overhead_s=0.005))
    result = sim.run([SimRequest(list(range(1, 9)), 3, 0.0), SimRequest([100, 101, 102, 103], 2, 0.015)])
    a, b = result.records
    assert (a.start_s, b.start_s) == (0.0, 0.015)
    assert a.chunk_times_s == pytest.approx([0.023, 0.038, 0.050])
    assert b.chunk_times_s == pytest.approx([0.023, 0.035])
    with pytest.raises(ValueError, match="-1"):
        RouterSpec(request_overhead_s=-1)
    assert_idle(sim)


def test_workers_sharing_cores_slow_each_other_down():
    # Two colocated workers with 1 thread each on 1 core: a step that starts while the other worker
    # computes takes twice as long (CoreSharing.slowdown(2 threads) = 2).
    # decode-0, A (8 tokens, 6 outputs): prefill [0, 18) alone -> token 1 at 18; a bulk run of 4
    #   decode steps of 11 ms from 18 (29, 40, 51, 62 planned).
    # decode-1, B (4 tokens, 1 output) arrives at 30: A is busy -> its prefill takes 2 x 14 = 28 ms,
    #   [30, 58): B's TTFT 28 ms. B turning busy cuts A's run after the step running at 30 (ends 40).
    # A from 40, B busy: a run of 2 steps of 22 ms (62, 84 planned); B turns idle at 58: the run is cut
    #   after the step running then (ends 62); A's last two steps alone: 73, 84.
    sharing = CoreSharing(num_cores=1, prefill_threads=1, decode_threads=1)
    sim = Simulation(cluster(0, 2, sharing=sharing))
    result = sim.run([SimRequest(list(range(1, 9)), 6, 0.0), SimRequest([100, 101, 102, 103], 1, 0.030)])
    a, b = result.records
    assert a.chunk_times_s == pytest.approx([0.018, 0.029, 0.040, 0.062, 0.073, 0.084])
    assert b.ttft_s == pytest.approx(0.028) and b.e2e_s == pytest.approx(0.028)
    assert [w["busy_s"] for w in result.workers] == pytest.approx([0.084, 0.028])
    assert_idle(sim)


def test_core_sharing_is_processor_sharing_of_the_busy_threads():
    sharing = CoreSharing(num_cores=2, prefill_threads=1, decode_threads=2)
    assert [sharing.threads(r) for r in ("prefill", "decode")] == [1, 2]
    assert [sharing.slowdown(n) for n in (1, 2, 3, 4)] == [1.0, 1.0, 1.5, 2.0]
    with pytest.raises(ValueError, match="num_cores must be >= 1, got 0"):
        CoreSharing(0, 1, 1)
    measured = CoreSharing(num_cores=2, prefill_threads=1, decode_threads=1, exponent=0.5)
    assert [measured.slowdown(n) for n in (2, 4, 8)] == pytest.approx([1.0, 2 ** 0.5, 2.0])
    with pytest.raises(ValueError, match="exponent must be in"):
        CoreSharing(2, 1, 1, exponent=-1)


def test_core_sharing_exponents_may_differ_by_role():
    sharing = CoreSharing(num_cores=2, prefill_threads=1, decode_threads=2, exponent=0.5, decode_exponent=0.0)
    # 3 busy threads on 2 cores: processor sharing's 1.5, to the prefill worker ** 0.5 (the shared
    # exponent), to the decode worker ** 0 (it loses nothing); role None: the shared exponent
    assert sharing.slowdown(3, "prefill") == pytest.approx(1.5 ** 0.5)
    assert sharing.slowdown(3, "decode") == 1.0
    assert sharing.slowdown(3) == pytest.approx(1.5 ** 0.5)
    assert (sharing.exponent_of("prefill"), sharing.exponent_of("decode")) == (0.5, 0.0)
    with pytest.raises(ValueError, match="prefill_exponent must be in"):
        CoreSharing(2, 1, 1, prefill_exponent=5)


def test_step_sizes_are_batch_sizes_for_decode_and_new_tokens_for_prompt_steps():
    assert [adapter.step_size(n, n) for n in (1, 2, 64)] == [("decode", 1), ("decode", 2), ("decode", 64)]
    assert adapter.step_size(16, 1) == ("prefill", 16)
    assert adapter.step_size(20, 5) == ("prefill", 20)  # prompt tokens beside decodes


def test_jittered_steps_draw_the_measured_ratio_of_their_kind_and_size():
    # One colocated worker; prompt steps of ~8 tokens ran 0.5x the fit, 1-sequence decode steps 2x.
    # A (8 tokens, 3 outputs): prefill (10 + 8) x 0.5 = 9 ms -> token 1 at 9; decode steps
    # (10 + 1) x 2 = 22 ms -> tokens at 31 and 53 (the bulk decode run draws per step too).
    samples = {"prefill": [(8, 0.5)] * 8 + [(1000, 3.0)] * 8, "decode": [(1, 2.0)] * 8 + [(2, 9.0)] * 8}
    worker = fitted_worker(COST, ENGINE, COST.kv_bytes_per_token)
    jittered = dataclasses.replace(worker, timer=adapter.JitteredTimer(worker.timer, samples, seed=3))
    spec = ClusterSpec(0, 1, jittered, jittered, router=RouterSpec("round_robin"))
    (a,) = Simulation(spec).run([SimRequest(list(range(1, 9)), 3, 0.0)]).records
    assert a.chunk_times_s == pytest.approx([0.009, 0.031, 0.053])


def test_a_step_draws_from_its_k_nearest_passes_of_its_kind():
    timer = adapter.CostModelTimer(COST)
    samples = {"decode": [(1, 1.0)] * 20 + [(2, 1.1)] * 3 + [(3, 0.9)] * 3 + [(8, 1.3)] * 2,
               "prefill": [(16, 1.5), (32, 1.4), (64, 1.2), (256, 1.0), (512, 0.9), (1024, 1.3)]}
    jittered = adapter.JitteredTimer(timer, samples, k=4)
    assert jittered.ratios_for("decode", 1) == [1.0] * 20  # every pass tied at the k-th distance
    # 2 sequences: its 3 passes, then the nearest in log size (the 3-sequence ones, all tied)
    assert sorted(jittered.ratios_for("decode", 2)) == [0.9] * 3 + [1.1] * 3
    assert sorted(jittered.ratios_for("prefill", 300)) == [0.9, 1.0, 1.2, 1.3]  # 256, 512, 64, 1024
    assert sorted(jittered.ratios_for("prefill", 16)) == [1.0, 1.2, 1.4, 1.5]
    only_decode = adapter.JitteredTimer(timer, {"decode": [(1, 2.0)]})
    assert only_decode.ratios_for("prefill", 100) == [2.0]  # no prompt pass measured: the other kind's
    assert adapter.JitteredTimer(timer, {}).ratios_for("prefill", 100) == (1.0,)  # nothing measured: the fit
    # the draws are seeded: the same seed gives the same steps, in call order
    mixed = {"decode": [(1, 0.5), (1, 1.0), (1, 1.5), (1, 2.0)]}
    features = adapter.StepFeatures(1, 1, 0.0, 1)
    one, again = adapter.JitteredTimer(timer, mixed, seed=7), adapter.JitteredTimer(timer, mixed, seed=7)
    assert [one.step_s(features) for _ in range(20)] == [again.step_s(features) for _ in range(20)]
    assert {round(one.step_s(features) / 0.011, 6) for _ in range(200)} == {0.5, 1.0, 1.5, 2.0}
    with pytest.raises(ValueError, match="> 0"):
        adapter.JitteredTimer(timer, {"decode": [(1, 0.0)]})
    with pytest.raises(ValueError, match="k must be >= 1"):
        adapter.JitteredTimer(timer, {}, k=0)


def test_a_live_fit_publishes_what_the_simulated_steps_took():
    # Calibration says 50 ms + 5 ms per token; the steps really take 10 ms + 1 ms per token (COST).
    # Before any step the heartbeat carries the calibration's fit; after 40 requests' steps fill
    # the 512-step window, the steps' own model (the fit is exact on noise-free steps).
    from core.cost_model import StepSample
    calibration = tuple(StepSample(n, s, 0.0, 0.050 + 0.005 * n) for n, s in ((1, 1), (16, 1), (64, 1), (4, 4),
                                                                                (8, 8), (32, 2), (128, 1), (2, 2)))
    worker = dataclasses.replace(fitted_worker(COST, ENGINE, COST.kv_bytes_per_token), live_fit=True,
                                 calibration=calibration)
    sim = Simulation(ClusterSpec(0, 1, worker, worker, router=RouterSpec("round_robin")), decode_runs=True)
    (w,) = sim.decode
    before = w.published_cost(0.0)
    assert [before.step_s(n, 1, 0.0) for n in (1, 16, 64)] == pytest.approx([0.055, 0.130, 0.370], rel=1e-3)
    assert before.kv_load_bytes_per_s == COST.kv_load_bytes_per_s  # the spec's fields stay
    requests = [SimRequest(list(range(1, 5 + i % 20)), 12 + i % 7, 0.2 * i) for i in range(60)]
    sim.run(requests)
    after = w.published_cost(sim.now_s)
    assert w.stats.num_steps > 512 + len(calibration)
    # (the steps ran one sequence at a time: base and per-sequence cost are one term, so compare
    # predictions)
    assert [after.step_s(n, 1, 0.0) for n in (1, 16, 64)] == pytest.approx([0.011, 0.026, 0.074], rel=1e-3)
    assert_idle(sim)


def test_cost_schedules_replay_each_workers_published_fits():
    a, b, c = (CostModel(base_s=x, per_token_s=0.001, num_samples=1) for x in (0.01, 0.02, 0.03))
    worker = dataclasses.replace(fitted_worker(COST, ENGINE, COST.kv_bytes_per_token),
                                 cost_schedules=(((0.0, a), (1.0, b)), ((0.0, c),)))
    sim = Simulation(ClusterSpec(0, 3, worker, worker, router=RouterSpec("round_robin")))
    first, second, third = sim.decode
    assert [first.published_cost(t) for t in (0.0, 0.5, 1.0, 7.0)] == [a, a, b, b]
    assert second.published_cost(3.0) == c
    assert third.published_cost(3.0) == b  # worker 2 of 3 takes schedule 2 mod 2
    plain = Simulation(cluster(0, 1)).decode[0]
    assert plain.published_cost(5.0) is plain.spec.cost  # no schedule, no live fit: the spec's
