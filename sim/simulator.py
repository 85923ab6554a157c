"""The discrete-event loop: arrivals, the real router's placements, the real schedulers' steps
timed by a step timer, KV transfers over each worker's NIC, and the records ``tandem bench``
would have measured.

Events sit in one heap ordered by (time, sequence); a worker's step is two events (scheduled at
its start, applied at its end), so requests that arrive meanwhile join at the next step, as on a
real worker. Heartbeats are not events: a worker's ``WorkerInfo.load`` is refreshed from its
scheduler when a placement reads it and the last refresh is ``heartbeat_interval_s`` old.
A request reaches the workers ``RouterSpec.request_overhead_s`` after it arrives; workers that
share CPU cores (``ClusterSpec.sharing``) stretch each other's steps (``_slowdown``).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass, field

from bench.client import RequestRecord
from bench.metrics import meets_slo
from core.cost_model import CostModel, StepSample
from engine.step_stats import StepStats
from router.errors import RouterError
from router.placement.prediction import Placement
from sim.adapter import SAMPLED_TOKEN_ID, SimEngine, SimRouter, worker_info
from sim.cluster import ClusterSpec, WorkerSpec
from sim.pool import SimPool
from sim.workload import SimRequest


@dataclass
class _Worker:
    spec: WorkerSpec
    engine: SimEngine
    info: object  # core.registry.WorkerInfo
    busy: bool = False
    busy_s: float = 0.0
    num_steps: int = 0
    nic_free_at_s: float = 0.0
    beat_at_s: float = -1e18
    # A bulk decode run in progress: the end time of each of its steps (absolute seconds).
    run_ends_s: list[float] = field(default_factory=list)
    run_features: list = field(default_factory=list)  # of each step of the run (sim.hardware.StepFeatures)
    run_start_s: float = 0.0
    run_generation: int = 0
    # WorkerSpec.live_fit: the worker's own step-time fit, and the step running now (recorded at its end)
    stats: StepStats | None = None
    step_sample: tuple | None = None  # (features, duration_s)
    cost_schedule: tuple = ()  # WorkerSpec.cost_schedules: this worker's
    _schedule_times: list[float] = field(default_factory=list)

    def published_cost(self, now_s: float) -> CostModel:
        """The cost model this worker's heartbeat carries at ``now_s``: its spec's cost schedule,
        its live fit or its spec's cost."""
        cost, schedule = self.spec.cost, self.cost_schedule
        if schedule:
            i = bisect.bisect_right(self._schedule_times, now_s) - 1
            return schedule[max(i, 0)][1]
        if self.stats is None:
            return cost
        return self.stats.model(max_num_batched_tokens=cost.max_num_batched_tokens,
                                kv_load_bytes_per_s=cost.kv_load_bytes_per_s, kv_bytes_per_token=cost.kv_bytes_per_token)

    def record(self, features, duration_s: float) -> None:
        """Feeds one finished step (its sim.hardware.StepFeatures, seconds) to the live fit
        (no-op without one)."""
        if self.stats is not None:
            self.stats.record(StepSample(features.num_new_tokens, features.num_seqs, features.attn_pairs, duration_s))

    def transfer(self, now_s: float, num_tokens: int) -> float:
        """When a KV transfer of ``num_tokens`` through this worker's NIC, queued behind earlier
        ones, completes."""
        duration_s = self.spec.transfer_s(num_tokens)
        if duration_s == 0.0:
            return now_s
        start_s = max(now_s, self.nic_free_at_s)
        self.nic_free_at_s = start_s + duration_s
        return self.nic_free_at_s


@dataclass
class _Run:
    index: int
    request: SimRequest
    record: RequestRecord
    placement: Placement | None = None
    block_hashes: tuple = ()
    num_pool_cached_tokens: int = 0
    missed: bool = False  # counted in Simulation.num_misses (refused, past its TTFT SLO, or ended outside the SLO)


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    workers: list[dict] = field(default_factory=list)  # per worker: id, role, busy_s, utilisation, ...
    pool_hit_rate: float = float("nan")
    prefix_cache_hit_rate: float = float("nan")
    num_events: int = 0
    aborted: bool = False  # stopped early (Simulation.run's max_misses): records are incomplete
    num_arrived: int = 0  # requests whose arrival was simulated (all of them unless aborted)
    num_misses: int = 0  # of them, outside the SLO (with Simulation.run's slo; in flight ones not counted)


class Simulation:
    """One cluster replaying one request list; :meth:`run` once."""

    def __init__(self, cluster: ClusterSpec, decode_runs: bool = True):
        self.cluster = cluster
        self.decode_runs = decode_runs  # apply stretches of pure decode steps in bulk (SimEngine.advance_decode)
        bs = cluster.decode.engine.block_size
        self.pool = SimPool(cluster.pool_capacity_blocks)
        r = cluster.router
        self.router = SimRouter(r.policy, r.disaggregation, r.slo, r.max_queue_s,
                                self.pool.num_leading if cluster.num_prefill else None)
        self.prefill = [self._worker(i, "prefill", cluster.prefill, bs) for i in range(cluster.num_prefill)]
        self.decode = [self._worker(i, "decode", cluster.decode, bs) for i in range(cluster.num_decode)]
        self._by_id = {w.info.worker_id: w for w in (*self.prefill, *self.decode)}
        self._runs: dict[str, _Run] = {}
        self._busy_ids: set[str] = set()  # workers counted busy for CPU sharing (_sharing_update)
        self._heap: list = []
        self._seq = itertools.count()
        self.now_s = 0.0
        self.num_events = 0
        self._slo, self._max_misses, self.num_misses = None, None, 0

    @staticmethod
    def _worker(index: int, role: str, spec: WorkerSpec, block_size: int) -> _Worker:
        worker = _Worker(spec, SimEngine(spec.engine), worker_info(f"{role}-{index}", role, block_size))
        if spec.cost_schedules:
            worker.cost_schedule = spec.cost_schedules[index % len(spec.cost_schedules)]
            worker._schedule_times = [t for t, _ in worker.cost_schedule]
        if spec.live_fit:
            worker.stats = StepStats()
            for sample in spec.calibration:
                worker.stats.record(sample)
        return worker

    def _at(self, time_s: float, fn, *args) -> None:
        heapq.heappush(self._heap, (time_s, next(self._seq), fn, args))

    def run(self, requests: list[SimRequest], slo=None, max_misses: int | None = None) -> SimResult:
        """Replays ``requests`` until every one has ended; returns the records (workload order).

        With ``slo`` (bench.metrics.SLO) and ``max_misses``: stops as soon as more than
        ``max_misses`` requests are certain to miss the SLO, with ``aborted`` set (the planner's
        early exit: the configuration cannot reach its attainment target). A request is certain
        to miss when it is refused, ends outside the SLO, or has no first token when its TTFT
        SLO has passed (counted then, not when it ends: an overloaded cluster stops sooner).
        Which configurations stop is the same either way; only when.
        """
        self._slo, self._max_misses, self.num_misses = slo, max_misses, 0
        deadline_s = slo.ttft_ms / 1000 + 1e-9 if slo is not None and max_misses is not None and slo.ttft_ms else None
        for index, request in enumerate(requests):  # the workers see it after the router's own time
            self._at(request.arrival_s + self.cluster.router.request_overhead_s, self._arrive, index, request)
            if deadline_s is not None:  # 1 ns after the SLO: a first token at the SLO itself meets it
                self._at(request.arrival_s + deadline_s, self._ttft_deadline, index)
        while self._heap and not (max_misses is not None and self.num_misses > max_misses):
            self.now_s, _, fn, args = heapq.heappop(self._heap)
            self.num_events += 1
            fn(*args)
        records = [self._runs[str(i)].record if str(i) in self._runs else RequestRecord(i, requests[i].arrival_s)
                   for i in range(len(requests))]
        result = self._result(records)
        result.aborted = bool(self._heap)
        result.num_arrived, result.num_misses = len(self._runs), self.num_misses
        return result

    def _miss(self, run: _Run) -> None:
        if not run.missed:
            run.missed = True
            self.num_misses += 1

    def _ttft_deadline(self, index: int) -> None:
        run = self._runs.get(str(index))  # None: still inside the router's overhead (counted when it ends)
        if run is not None and run.record.ttft_s is None:
            self._miss(run)

    # -- the router ---------------------------------------------------------------------------

    def _candidates(self, workers: list[_Worker]) -> list:
        limit = self.cluster.router.max_candidates
        for w in workers:
            if self.now_s - w.beat_at_s >= self.cluster.router.heartbeat_interval_s:
                w.info.load = w.engine.load(w.published_cost(self.now_s))
                w.beat_at_s = self.now_s
        if limit and len(workers) > limit:
            workers = sorted(workers, key=lambda w: w.engine.num_unfinished)[:limit]
        return [w.info for w in workers]

    def _arrive(self, index: int, request: SimRequest) -> None:
        rid = str(index)
        run = _Run(index, request, RequestRecord(index, request.arrival_s, prompt_tokens=len(request.prompt)))
        self._runs[rid] = run
        limit = self.cluster.decode.engine.max_model_len
        if len(request.prompt) + request.max_tokens > limit:  # the router's validation: HTTP 400
            run.record.error_kind = "http_400"
            run.record.error = f"prompt ({len(request.prompt)}) + max_tokens ({request.max_tokens}) > {limit}"
            self._miss(run)
            return
        try:
            run.placement, run.block_hashes = self.router.place(
                rid, request.prompt, request.max_tokens, self._candidates(self.prefill), self._candidates(self.decode))
        except RouterError as err:
            run.record.error_kind, run.record.error = f"http_{err.http_status}", err.message[:300]
            self._miss(run)
            return
        if run.placement.prefill is None:
            self._start_decode(run, self._by_id[run.placement.decode.worker_id], 0)
            return
        worker = self._by_id[run.placement.prefill.worker_id]
        self.router.track(rid, worker.info.address)
        bs = worker.spec.engine.block_size
        num_blocks = self.pool.load(run.block_hashes)
        run.num_pool_cached_tokens = min(num_blocks * bs, len(request.prompt) - 1) // bs * bs
        done_s = worker.transfer(self.now_s, run.num_pool_cached_tokens)
        self._at(done_s, self._add, worker, rid, request.prompt, 1, (), run.num_pool_cached_tokens)

    def _add(self, worker: _Worker, rid: str, prompt, max_tokens: int, outputs: tuple, num_external: int) -> None:
        if worker.run_ends_s:  # a decode run in progress ends with the step running now
            self._end_decode_run(worker, min(len(worker.run_ends_s), bisect.bisect_left(worker.run_ends_s, self.now_s) + 1))
        worker.engine.add(rid, prompt, max_tokens, outputs, num_external)
        self._kick(worker)

    def _start_decode(self, run: _Run, worker: _Worker, num_prompt_kv_tokens: int) -> None:
        self.router.track(str(run.index), worker.info.address)
        self.router.decoding(run.placement, worker.info.address)
        outputs = (SAMPLED_TOKEN_ID,) if num_prompt_kv_tokens else ()
        done_s = worker.transfer(self.now_s, num_prompt_kv_tokens)
        self._at(done_s, self._add, worker, str(run.index), run.request.prompt, run.request.max_tokens, outputs,
                 num_prompt_kv_tokens)

    # -- the workers --------------------------------------------------------------------------

    def _kick(self, worker: _Worker) -> None:
        """Starts the worker's next step unless one is running or it has nothing to do."""
        if worker.busy or not worker.engine.num_unfinished:
            return
        num_steps = worker.engine.decode_run_steps() if self.decode_runs else 0
        if num_steps >= 2:
            self._start_decode_run(worker, num_steps)
            return
        out, features = worker.engine.schedule()
        if out.is_empty:
            return
        duration_s = worker.spec.timer.step_s(features) * self._slowdown(worker)
        worker.busy, worker.busy_s, worker.num_steps = True, worker.busy_s + duration_s, worker.num_steps + 1
        if worker.stats is not None:
            worker.step_sample = (features, duration_s)
        self._at(self.now_s + duration_s, self._step_done, worker, out)
        self._sharing_update(worker)

    def _step_done(self, worker: _Worker, out) -> None:
        worker.busy = False
        if worker.step_sample is not None:
            worker.record(*worker.step_sample)
            worker.step_sample = None
        for rid, finished in worker.engine.apply(out):
            if worker.info.role == "prefill":
                self._prefilled(worker, self._runs[rid])
            else:
                self._token(worker, self._runs[rid], finished)
        self._kick(worker)
        self._sharing_update(worker)

    def _start_decode_run(self, worker: _Worker, num_steps: int) -> None:
        """Times ``num_steps`` pure decode steps now; they are applied when they end or when a
        request arrives at the worker meanwhile (then up to the step running at that moment)."""
        t, ends, slowdown = self.now_s, [], self._slowdown(worker)
        features_list = worker.engine.decode_run_features(num_steps)
        for features in features_list:
            t += worker.spec.timer.step_s(features) * slowdown
            ends.append(t)
        worker.busy, worker.run_ends_s, worker.run_start_s = True, ends, self.now_s
        worker.run_features = features_list
        worker.run_generation += 1
        self._at(ends[-1], self._decode_run_done, worker, worker.run_generation)
        self._sharing_update(worker)

    def _decode_run_done(self, worker: _Worker, generation: int) -> None:
        if generation == worker.run_generation and worker.run_ends_s:
            self._end_decode_run(worker, len(worker.run_ends_s))

    def _end_decode_run(self, worker: _Worker, num_steps: int) -> None:
        """Applies the run's first ``num_steps`` steps (their tokens at their end times); the
        worker takes its next step once the last of them ends."""
        ends = worker.run_ends_s[:num_steps]
        worker.busy_s += ends[-1] - worker.run_start_s
        if worker.stats is not None:  # a live fit: each step of the run is a sample
            for features, start_s, end_s in zip(worker.run_features, [worker.run_start_s, *ends], ends):
                worker.record(features, end_s - start_s)
        worker.num_steps += num_steps
        worker.run_ends_s, worker.run_generation = [], worker.run_generation + 1
        for rid in worker.engine.advance_decode(num_steps):
            record = self._runs[rid].record
            record.chunk_times_s.extend(t - record.start_s for t in ends)
        self._at(ends[-1], self._decode_run_free, worker, worker.run_generation)

    def _decode_run_free(self, worker: _Worker, generation: int) -> None:
        if generation == worker.run_generation:
            worker.busy = False
            self._kick(worker)
            self._sharing_update(worker)

    # -- CPU sharing (ClusterSpec.sharing: workers on one machine's cores) -----------------------

    def _slowdown(self, worker: _Worker) -> float:
        """How many times longer a step of ``worker`` starting now takes: 1 unless the workers
        share cores, else CoreSharing.slowdown of its threads plus every other busy worker's."""
        sharing = self.cluster.sharing
        if sharing is None:
            return 1.0
        threads = sharing.threads(worker.info.role) + sum(
            sharing.threads(w.info.role) for w in self._by_id.values() if w is not worker and w.busy)
        return sharing.slowdown(threads, worker.info.role)

    def _sharing_update(self, worker: _Worker) -> None:
        """When ``worker`` turned busy or idle on shared cores, the other workers' bulk decode
        runs stop after the step running now, so their next steps are timed at the new
        slowdown (a single step already running keeps its time: an approximation)."""
        if self.cluster.sharing is None or (worker.info.worker_id in self._busy_ids) == worker.busy:
            return
        (self._busy_ids.add if worker.busy else self._busy_ids.discard)(worker.info.worker_id)
        for other in self._by_id.values():
            if other is not worker and other.run_ends_s:
                self._end_decode_run(other, min(len(other.run_ends_s), bisect.bisect_left(other.run_ends_s, self.now_s) + 1))

    def _prefilled(self, worker: _Worker, run: _Run) -> None:
        """The first token is sampled: the new blocks go to the pool, then the router has TTFT."""
        n = len(run.request.prompt)
        done_s = worker.transfer(self.now_s, n - run.num_pool_cached_tokens)
        self._at(done_s, self._first_token_from_prefill, worker, run)

    def _first_token_from_prefill(self, worker: _Worker, run: _Run) -> None:
        self.pool.store(run.block_hashes)
        self.router.untrack(str(run.index), worker.info.address)
        self._first_token(run)
        if run.request.max_tokens <= 1:
            self._finish(run, None)
            return
        self._start_decode(run, self._by_id[run.placement.decode.worker_id], len(run.request.prompt))

    def _first_token(self, run: _Run) -> None:
        record = run.record
        record.ttft_s = self.now_s - record.start_s
        record.chunk_times_s.append(record.ttft_s)
        self.router.first_token(run.placement, record.ttft_s)

    def _token(self, worker: _Worker, run: _Run, finished: bool) -> None:
        if run.record.ttft_s is None:
            self._first_token(run)
        else:
            run.record.chunk_times_s.append(self.now_s - run.record.start_s)
        if finished:
            self._finish(run, worker)

    def _finish(self, run: _Run, worker: _Worker | None) -> None:
        record = run.record
        record.e2e_s = self.now_s - record.start_s
        record.output_tokens, record.finish_reason = len(record.chunk_times_s), "length"
        self.router.finished(run.placement)
        if self._slo is not None and not meets_slo(record, self._slo):
            self._miss(run)
        if worker is not None:
            self.router.untrack(str(run.index), worker.info.address)

    # -- the result ---------------------------------------------------------------------------

    def _result(self, records: list[RequestRecord]) -> SimResult:
        duration_s = max((r.start_s + (r.e2e_s or 0.0) for r in records), default=0.0)
        workers, queried, hit = [], 0, 0
        for w in (*self.prefill, *self.decode):
            q, h = w.engine.prefix_hit_rate()
            queried, hit = queried + q, hit + h
            workers.append({"worker_id": w.info.worker_id, "role": w.info.role, "num_gpus": w.spec.num_gpus,
                            "busy_s": w.busy_s, "num_steps": w.num_steps,
                            "utilisation": w.busy_s / duration_s if duration_s else float("nan"),
                            "num_preemptions": w.engine.num_preemptions,
                            "num_unfinished": w.engine.num_unfinished,
                            "num_used_blocks": w.engine.num_used_blocks})
        return SimResult(records, duration_s, workers, self.pool.hit_rate,
                         hit / queried if queried else float("nan"), self.num_events)
