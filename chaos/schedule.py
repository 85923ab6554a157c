"""A fault campaign as data: YAML in, frozen dataclasses out, every field checked once.

::

    seed: 7                       # drives every random choice (which requests, when in a storm)
    deadline_s: 120               # a request not ended by then is lost
    cluster: {num_prefill_workers: 2, num_decode_workers: 2, pool_capacity_bytes: 268435456}
    workload: {kind: prompts, num_requests: 24, max_tokens: 24, concurrency: 8}
    scenarios:
      - name: decode worker hangs
        faults:
          - {at_tokens: 60, do: sigstop, service: decode-1, duration_s: 15}
      - name: redis restart
        faults:
          - {at_s: 3, do: redis_restart}

A fault runs when the scenario has run ``at_s`` seconds or its clients have received
``at_tokens`` tokens (exactly one of the two). ``do`` is one of :data:`FAULT_KINDS`; see
chaos.faults for what each does and which fields it reads. ``cluster`` takes
``tandem up``'s option names (launcher.config.ClusterConfig.from_options); ``workload`` takes
bench.workloads.WorkloadConfig fields plus ``concurrency`` (requests in flight, closed loop) and ``duration_s`` (send for that
long, cycling the workload; 0: each request once).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import yaml

FAULT_KINDS = (
    "sigkill", "sigstop", "redis_restart", "redis_down", "redis_pause", "pool_dram_full", "transfer",
    "disconnect", "abort_storm", "burst", "partition", "slow_link", "throttle_link", "drop_connections",
)
# On the link to a worker (from the routers), to a pool node (from the workers and routers) or to
# Redis from one service (``client``): chaos.link_proxy
LINK_FAULTS = ("partition", "slow_link", "throttle_link", "drop_connections")
SERVICE_FAULTS = ("sigkill", "sigstop", *LINK_FAULTS)  # need ``service``
LINK_DIRECTIONS = ("both", "to_server", "to_client")
DISCONNECT_STAGES = ("before_first_token", "mid_transfer", "mid_decode")
TRANSFER_MODES = ("delay", "error", "truncate", "corrupt")


@dataclass(frozen=True)
class Fault:
    """One fault of a scenario. Raises ValueError naming the field."""

    do: str
    at_s: float | None = None
    at_tokens: int | None = None
    service: str = ""  # sigkill / sigstop: a service name (redis, kv_pool, prefill, decode-1, ...)
    duration_s: float = 0.0  # sigstop, redis_down, redis_pause, pool_dram_full, transfer, disconnect
    fraction: float = 0.5  # disconnect, abort_storm: share of requests affected
    stage: str = "mid_decode"  # disconnect: when the client goes
    multiplier: int = 10  # burst: extra requests = multiplier x concurrency, sent at once
    mode: str = "delay"  # transfer: delay | error | truncate | corrupt
    methods: tuple[str, ...] = ("GetBlocks", "LocateBlocks")  # transfer: pool RPCs hit
    delay_s: float = 1.0  # transfer delay
    probability: float = 1.0  # transfer: share of matching RPCs hit
    # partition: which way packets are dropped between the routers and ``service``: both, to_server
    # (the routers' requests), to_client (the worker's answers)
    direction: str = "both"
    # a link fault on ``service: redis``: the service whose Redis connection it hits (router,
    # router-0, decode-1, kv_pool, ...); the others keep theirs
    client: str = ""
    bytes_per_s: int = 0  # throttle_link: the link's cap, each way

    def __post_init__(self) -> None:
        if self.do not in FAULT_KINDS:
            raise ValueError(f"do must be one of {FAULT_KINDS}, got {self.do!r}")
        if (self.at_s is None) == (self.at_tokens is None):
            raise ValueError(f"a fault needs exactly one of at_s and at_tokens, got at_s={self.at_s!r}, "
                             f"at_tokens={self.at_tokens!r}")
        if (self.at_s is not None and self.at_s < 0) or (self.at_tokens is not None and self.at_tokens < 0):
            raise ValueError(f"at_s and at_tokens must be >= 0, got {self.at_s!r}, {self.at_tokens!r}")
        if self.do in SERVICE_FAULTS and not self.service:
            raise ValueError(f"{self.do} needs service (a service name such as decode-1)")
        if self.duration_s < 0 or self.delay_s < 0:
            raise ValueError(f"duration_s and delay_s must be >= 0, got {self.duration_s!r}, {self.delay_s!r}")
        if not 0 <= self.fraction <= 1 or not 0 <= self.probability <= 1:
            raise ValueError(f"fraction and probability must be in [0, 1], got {self.fraction!r}, {self.probability!r}")
        if self.stage not in DISCONNECT_STAGES:
            raise ValueError(f"stage must be one of {DISCONNECT_STAGES}, got {self.stage!r}")
        if self.mode not in TRANSFER_MODES:
            raise ValueError(f"mode must be one of {TRANSFER_MODES}, got {self.mode!r}")
        if self.direction not in LINK_DIRECTIONS:
            raise ValueError(f"direction must be one of {LINK_DIRECTIONS}, got {self.direction!r}")
        if self.do in LINK_FAULTS and self.duration_s <= 0:
            raise ValueError(f"{self.do} needs duration_s > 0 (the link heals after it)")
        if self.do in LINK_FAULTS and not self.service.startswith(("prefill", "decode", "kv_pool", "redis")):
            raise ValueError(f"{self.do} needs a worker, pool node or redis service (prefill, decode-1, kv_pool, "
                             f"redis, ...), got {self.service!r}")
        if self.do in LINK_FAULTS and (self.service == "redis") != bool(self.client):
            raise ValueError(f"{self.do}: client (whose Redis connection: router, decode-1, kv_pool, ...) goes with "
                             f"service redis and only with it, got service={self.service!r}, client={self.client!r}")
        if self.client and not self.client.startswith(("router", "prefill", "decode", "kv_pool")):
            raise ValueError(f"client must be a router, worker or pool node service, got {self.client!r}")
        if self.do == "throttle_link" and self.bytes_per_s < 1:
            raise ValueError(f"throttle_link needs bytes_per_s >= 1, got {self.bytes_per_s!r}")
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier!r}")

    @property
    def link(self) -> str:
        """The link proxy a link fault drives: the service's own (``decode-1``), or for Redis the
        connection of its client (``redis/router``)."""
        return f"redis/{self.client}" if self.client else self.service

    @property
    def label(self) -> str:
        when = f"{self.at_s:g} s" if self.at_s is not None else f"{self.at_tokens} tokens"
        what = f"{self.do} {self.service}".strip() + (f" from {self.client}" if self.client else "")
        if self.do == "transfer":
            what += f" {self.mode}"
        if self.do == "disconnect":
            what += f" {self.stage}"
        if self.do == "partition" and self.direction != "both":
            what += f" {self.direction}"
        if self.do == "slow_link":
            what += f" +{self.delay_s:g} s"
        if self.do == "throttle_link":
            what += f" {self.bytes_per_s} B/s"
        if self.do == "drop_connections" and self.probability < 1:
            what += f" p={self.probability:g}"
        return f"{what} @ {when}" + (f" for {self.duration_s:g} s" if self.duration_s else "")


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: tuple[Fault, ...]
    duration_s: float | None = None  # replaces the campaign's workload.duration_s for this scenario
    # > 0: an open loop at this fraction of the completion rate the scenario before it measured
    # (its completed requests / its duration); 0: the campaign's closed loop
    capacity_fraction: float = 0.0


@dataclass(frozen=True)
class Campaign:
    """Everything one ``tandem chaos`` run needs. Raises ValueError naming the field."""

    scenarios: tuple[Scenario, ...]
    seed: int = 0
    deadline_s: float = 120.0
    idle_bound_s: float = 75.0  # after a scenario, workers and pool must be idle within this
    cluster: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    concurrency: int = 8
    duration_s: float = 0.0  # > 0: each scenario sends for this long, cycling the workload (a soak)
    sample_every_s: float = 0.0  # > 0: gauges and RSS sampled this often (chaos/sampler.py; a soak)

    def __post_init__(self) -> None:
        if self.duration_s < 0:
            raise ValueError(f"workload.duration_s must be >= 0, got {self.duration_s!r}")
        if self.sample_every_s < 0:
            raise ValueError(f"sample_every_s must be >= 0, got {self.sample_every_s!r}")
        if not self.scenarios:
            raise ValueError("scenarios must not be empty")
        if self.deadline_s <= 0 or self.idle_bound_s <= 0:
            raise ValueError(f"deadline_s and idle_bound_s must be > 0, got {self.deadline_s!r}, {self.idle_bound_s!r}")
        if self.concurrency < 1:
            raise ValueError(f"workload.concurrency must be >= 1, got {self.concurrency!r}")


def _fault(data: object, where: str) -> Fault:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a fault must be a mapping, got {data!r}")
    known = {f.name for f in dataclasses.fields(Fault)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown fault field(s) {unknown}; known: {sorted(known)}")
    values = dict(data)
    if "methods" in values:
        values["methods"] = tuple(values["methods"])
    try:
        return Fault(**values)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


def parse_campaign(data: object) -> Campaign:
    """The campaign of a parsed YAML document. Raises ValueError naming the bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"a campaign must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - {"seed", "deadline_s", "idle_bound_s", "cluster", "workload", "scenarios", "sample_every_s"})
    if unknown:
        raise ValueError(f"unknown campaign field(s) {unknown}")
    scenarios = []
    for i, entry in enumerate(data.get("scenarios") or []):
        if not isinstance(entry, dict) or not entry.get("name"):
            raise ValueError(f"scenarios[{i}] needs a name")
        unknown = sorted(set(entry) - {"name", "faults", "duration_s", "capacity_fraction"})
        if unknown:
            raise ValueError(f"scenarios[{i}]: unknown field(s) {unknown}")
        faults = tuple(_fault(f, f"scenarios[{i}].faults[{j}]") for j, f in enumerate(entry.get("faults") or []))
        duration_s = entry.get("duration_s")
        fraction = float(entry.get("capacity_fraction", 0.0))
        if duration_s is not None and float(duration_s) <= 0:
            raise ValueError(f"scenarios[{i}].duration_s must be > 0, got {duration_s!r}")
        if not 0 <= fraction <= 2:
            raise ValueError(f"scenarios[{i}].capacity_fraction must be in [0, 2], got {fraction!r}")
        if fraction and not scenarios:
            raise ValueError(f"scenarios[{i}].capacity_fraction needs a scenario before it to measure capacity")
        scenarios.append(Scenario(str(entry["name"]), faults, None if duration_s is None else float(duration_s), fraction))
    workload = dict(data.get("workload") or {})
    concurrency = int(workload.pop("concurrency", 8))
    duration_s = float(workload.pop("duration_s", 0.0))
    return Campaign(tuple(scenarios), int(data.get("seed", 0)), float(data.get("deadline_s", 120.0)),
                    float(data.get("idle_bound_s", 75.0)), dict(data.get("cluster") or {}), workload, concurrency,
                    duration_s, float(data.get("sample_every_s", 0.0)))


def load_campaign(path: Path) -> Campaign:
    """Reads a campaign YAML file. Raises ValueError (bad content) or OSError (unreadable)."""
    try:
        return parse_campaign(yaml.safe_load(Path(path).read_text()))
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: not YAML: {err}") from None
