"""What is simulated: the workers (engine config, step timer, transfer bandwidth), their counts,
the pool and the router (policy, SLOs, heartbeat period)."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.cost_model import CostModel, StepSample, StepTimeFit, prefill_attn_pairs
from engine.config import EngineConfig
from router.placement.prediction import SLO
from sim.adapter import CostModelTimer, StepTimer
from sim.hardware import Roofline, StepFeatures


@dataclass(frozen=True)
class WorkerSpec:
    """One worker kind: its engine (the real EngineConfig), how long its steps take, the cost
    model it publishes in its heartbeat, and its KV transfer bandwidth to and from the pool.

    ``live_fit``: each worker publishes, as a real one does, the fit of its own recent steps (the
    real ``engine.step_stats.StepStats``, window 512, refit every 16 steps) seeded with
    ``calibration`` (the passes a real worker ran before serving: its start-up calibration and
    whatever came before the workload), instead of ``cost`` throughout; ``cost`` keeps its budget
    and KV bandwidth fields. The router then sees the simulated workers' load the way it sees
    real ones: a fit that drifts with the batches they run. ``cost_schedules`` instead replay given
    sequences of published fits (time-ordered), one per worker.
    """

    engine: EngineConfig
    timer: StepTimer
    cost: CostModel
    kv_bytes_per_token: float
    kv_transfer_bytes_per_s: float  # 0: transfers take no time
    num_gpus: int = 1  # tensor-parallel degree
    live_fit: bool = False
    calibration: tuple[StepSample, ...] = ()
    # Per worker of this kind (worker i takes schedule i mod their number): (from time s, cost
    # model) published instead of ``cost`` from each time on (replayed real workers' fits over
    # their run, benchmarks/sim_validation.py); takes precedence over live_fit.
    cost_schedules: tuple[tuple[tuple[float, CostModel], ...], ...] = ()

    def transfer_s(self, num_tokens: int) -> float:
        if num_tokens <= 0 or self.kv_transfer_bytes_per_s <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / self.kv_transfer_bytes_per_s


@dataclass(frozen=True)
class RouterSpec:
    policy: str = "predicted_latency"
    disaggregation: str = "auto"
    slo: SLO = field(default_factory=SLO)  # the router's (admission, placement); 0: none
    max_queue_s: float = 0.5
    heartbeat_interval_s: float = 1.0  # as worker.config.WorkerConfig
    # Candidates per role handed to the policy: the least loaded ``max_candidates`` (0: all).
    # predicted_latency scores every (prefill, decode) pair; at 64 x 64 that is 4096 pairs a request.
    max_candidates: int = 0
    # The router's and the transport's own time per request: HTTP parsing, tokenization and
    # validation, placement, the gRPC hops to the first worker and the first token's way back
    # (SSE). The request reaches the workers this long after it arrived (adds to TTFT).
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.request_overhead_s < 0:
            raise ValueError(f"request_overhead_s must be >= 0, got {self.request_overhead_s}")


@dataclass(frozen=True)
class CoreSharing:
    """Workers that share one machine's CPU cores, as ``tandem up`` runs them (each with the
    threads the launcher gives its role, launcher.commands.worker_threads): a step that starts
    while other workers are busy runs slower, by processor sharing of the busy threads over the
    cores (``slowdown``). None in ClusterSpec: every worker has its own device (GPUs).

    ``exponent`` 1 is plain processor sharing; a measured one (benchmarks/step_timeline.py: the
    slowdown of passes that ran beside a neighbour's against those that ran alone) says how much
    of it this machine shows: less when other processes already load the cores (the workers'
    share of a busy machine shrinks less when a neighbour wakes), more when OpenMP teams stall.
    ``prefill_exponent`` / ``decode_exponent`` (None: ``exponent``) set it per role: the roles
    need not lose alike (here a 2-thread decode worker beside a 1-thread prefill worker slowed
    1.01x, the prefill worker 1.35x, where processor sharing gives both 1.5x).
    """

    num_cores: int
    prefill_threads: int
    decode_threads: int
    exponent: float = 1.0
    prefill_exponent: float | None = None
    decode_exponent: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_cores", "prefill_threads", "decode_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("exponent", "prefill_exponent", "decode_exponent"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 4:
                raise ValueError(f"{name} must be in [0, 4], got {value}")

    def threads(self, role: str) -> int:
        return self.prefill_threads if role == "prefill" else self.decode_threads

    def exponent_of(self, role: str) -> float:
        own = self.prefill_exponent if role == "prefill" else self.decode_exponent
        return self.exponent if own is None else own

    def slowdown(self, num_busy_threads: int, role: str | None = None) -> float:
        """How many times longer a step (of a ``role`` worker; None: at ``exponent``) takes while
        ``num_busy_threads`` threads (its own included) compute on the cores: 1 while they fit,
        else (threads / cores) ** exponent (exponent 1: each thread gets a fair share of a core)."""
        exponent = self.exponent if role is None else self.exponent_of(role)
        return max(1.0, num_busy_threads / self.num_cores) ** exponent


# The pool's capacity when none is given, whatever a block's size: more blocks than the full
# Mooncake conversation trace stores at block size 32 or more (93.6M distinct prompt tokens).
DEFAULT_POOL_BLOCKS = 1 << 22


@dataclass(frozen=True)
class ClusterSpec:
    """``num_prefill`` 0 is colocated: the decode workers prefill in chunks."""

    num_prefill: int
    num_decode: int
    prefill: WorkerSpec
    decode: WorkerSpec
    pool_capacity_blocks: int = DEFAULT_POOL_BLOCKS
    router: RouterSpec = field(default_factory=RouterSpec)
    sharing: CoreSharing | None = None  # the workers share CPU cores (a local cluster); None: not

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(f"need >= 0 prefill and >= 1 decode workers, got {self.num_prefill}, {self.num_decode}")
        if self.prefill.engine.block_size != self.decode.engine.block_size:
            raise ValueError("prefill and decode workers must share a block size (one KVCacheSpec)")

    @property
    def num_gpus(self) -> int:
        return self.num_prefill * self.prefill.num_gpus + self.num_decode * self.decode.num_gpus

    @property
    def label(self) -> str:
        if not self.num_prefill:
            return f"colocated {self.num_decode}x TP{self.decode.num_gpus}"
        return f"{self.num_prefill}P TP{self.prefill.num_gpus} + {self.num_decode}D TP{self.decode.num_gpus}"


def calibrate(timer: StepTimer, config: EngineConfig) -> CostModel:
    """The cost model a worker with these step times would fit of itself: the real StepTimeFit
    over prefill chunks and decode batches spanning the engine's budget (as engine.calibration
    runs, without a model)."""
    fit = StepTimeFit(window=512)
    budget = config.max_num_batched_tokens
    for n in sorted({1, 16, 64, 256, budget // 4, budget // 2, budget}):
        for cached in (0, budget, 4 * budget):
            f = StepFeatures(n, 1, prefill_attn_pairs(n, cached), cached + n)
            fit.add(StepSample(n, 1, f.attn_pairs, timer.step_s(f)))
    for batch in sorted({1, 4, 16, 64, config.max_num_seqs}):
        for context in (128, 1024, 8192):
            f = StepFeatures(batch, batch, batch * context / 1000, batch * context)
            fit.add(StepSample(batch, batch, f.attn_pairs, timer.step_s(f)))
    return fit.model(max_num_batched_tokens=budget)


def roofline_worker(roofline: Roofline, engine: EngineConfig) -> WorkerSpec:
    """A worker of a named GPU and model; its published cost model is calibrated on the roofline."""
    cost = calibrate(roofline, engine)
    bpt = roofline.model.kv_bytes_per_token
    cost = CostModel(cost.base_s, cost.per_token_s, cost.per_seq_s, cost.per_attn_s, cost.num_samples,
                     engine.max_num_batched_tokens, roofline.kv_transfer_bytes_per_s, bpt)
    return WorkerSpec(engine, roofline, cost, bpt, roofline.kv_transfer_bytes_per_s, roofline.tp)


def fitted_worker(cost: CostModel, engine: EngineConfig, kv_bytes_per_token: float) -> WorkerSpec:
    """A worker timed by a cost model fitted on a real machine (``cost.kv_load_bytes_per_s`` is
    its measured pool bandwidth)."""
    return WorkerSpec(engine, CostModelTimer(cost), cost, kv_bytes_per_token, cost.kv_load_bytes_per_s)
