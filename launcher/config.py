"""What a cluster runs, composed of the services' own configurations.

:class:`ClusterConfig` holds one :class:`~engine.config.EngineConfig` (the workers'),
:class:`~worker.config.WorkerConfig`, :class:`~router.config.RouterConfig` and
:class:`~kv_pool.config.PoolConfig`, each with its own defaults, plus what only a cluster has
(how many processes of each role, tensor parallelism, the thread budget, where logs go). A
setting is declared once, in its service's config: the services' ``--flags``, ``tandem up``'s
options (:data:`SECTIONS`) and the argv the launchers hand each service (launcher.commands) are
all generated from those fields (core.settings).

``tandem up``'s option names are flat: a service field keeps its name (``num_kv_blocks``,
``routing_policy``, ``kv_transfer``), a pool field gets ``pool_`` (``pool_capacity_bytes``);
:meth:`ClusterConfig.from_options` builds the nested config from them. The fields a cluster sets
itself per process (hosts, ports, Redis, the pool's address, thread counts, the router's model
and context, which are the engine's) are not options of their section.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.settings import option_fields, setting, take
from engine.config import EngineConfig
from kv_pool.config import PoolConfig
from launcher.supervisor import RestartPolicy
from router.config import RouterConfig
from worker.config import WorkerConfig


@dataclass(frozen=True)
class Section:
    """One service config inside :class:`ClusterConfig`: the attribute holding it, its ``tandem
    up`` option prefix, its fields the cluster sets per process, and those that are no ``tandem
    up`` option yet reach the process when a config changes them (neither kind is an option)."""

    attribute: str
    config: type
    prefix: str = ""
    set_by_cluster: frozenset[str] = frozenset()
    hidden: frozenset[str] = frozenset()

    def option_names(self) -> dict[str, str]:
        """``tandem up`` option name -> field name, for each field ``tandem up`` takes."""
        return {(f"{self.prefix}_{f.name}" if self.prefix else f.name): f.name
                for f in option_fields(self.config, self.set_by_cluster | self.hidden)}


SECTIONS = (
    Section("engine", EngineConfig, set_by_cluster=frozenset({"num_threads", "tensor_parallel_size"})),
    Section("worker", WorkerConfig, set_by_cluster=frozenset({
        "host", "port", "redis_url", "pool_address", "worker_id", "advertise_address", "metrics_port"}),
            hidden=frozenset({"log_level"})),
    Section("router", RouterConfig, set_by_cluster=frozenset({"host", "redis_url", "model", "max_model_len"})),
    Section("pool", PoolConfig, prefix="pool", set_by_cluster=frozenset({
        "host", "port", "redis_url", "node_id", "advertise_address", "metrics_port"})),
)


@dataclass(frozen=True)
class ClusterConfig:
    """What ``tandem up`` (or a test, a benchmark, a chaos campaign) starts. Raises ValueError on
    impossible sizes, and on a service config the cluster would hand a process that refuses it."""

    # The workers' engine; each worker's num_kv_blocks (prefill: see prefill_num_kv_blocks),
    # tensor_parallel_size (prefill_tp / decode_tp) and num_threads (num_threads) are set per role.
    engine: EngineConfig = setting(EngineConfig(), option=False)
    # The workers' process settings; host, ports, Redis and the pool's address are set per process.
    worker: WorkerConfig = setting(WorkerConfig(), option=False)
    # The routers'; router i listens on router.http_port + i and router.grpc_port + i; its model
    # and context limit are the engine's.
    router: RouterConfig = setting(RouterConfig(), option=False)
    # Every pool node's; ports and node ids are set per node.
    pool: PoolConfig = setting(PoolConfig(), option=False)
    host: str = setting("127.0.0.1", "Interface every service binds.")
    redis_url: str = setting("", "Use this Redis instead of starting a private redis-server.")
    num_threads: int = setting(0, "CPU threads split between the workers; 0: every core of this machine.")
    log_dir: Path = setting(Path(".cache/logs"), "Where each service's log goes (<service>.log).")
    colocated: bool = setting(False, "No prefill worker: the decode worker prefills in chunks mixed into its "
                                     "decode steps (Sarathi-Serve).")
    share_cores: bool = setting(True, "Disaggregated on one machine: a decode worker runs its passes on the prefill "
                                      "workers' cores too while they are idle (engine.core_share); off: each role "
                                      "keeps its own cores.")
    num_prefill_workers: int = setting(1, "Prefill worker processes.")
    num_decode_workers: int = setting(1, "Decode worker processes.")
    num_routers: int = setting(
        1, "Router processes serving the same cluster (the chart's router.replicas); router i listens on "
           "--http-port + i and --grpc-port + i. With several, one that exits is restarted like a worker while the "
           "others serve (clients retry on them: docs/failover.md).")
    num_pool_nodes: int = setting(1, "KV pool processes; the workers spread blocks over them (core.pool_ring).")
    prefill_tp: int = setting(1, "Tensor-parallel ranks of each prefill worker (one GPU each on CUDA; threads split "
                                 "on the CPU).")
    decode_tp: int = setting(1, "Tensor-parallel ranks of each decode worker; may differ from --prefill-tp (the "
                                "pool's KV blocks do not depend on it).")
    prefill_num_kv_blocks: int = setting(0, "KV cache blocks of each prefill worker; 0: --num-kv-blocks.")
    # Keys clients must send to the router (router.api.auth); empty: open. Passed in the
    # environment, never in argv (which `ps` shows).
    api_keys: tuple[str, ...] = setting((), option=False)
    # Shared secret of the cluster's internal RPCs (core.grpc_auth); empty: none. Environment only.
    cluster_token: str = setting("", option=False)
    # Restarts of exited worker and pool processes (max_restarts 0: any exit stops the cluster).
    restart: RestartPolicy = setting(RestartPolicy(), option=False)
    # Workers find the pool nodes in Redis instead of being handed this cluster's (nodes started
    # outside the cluster then join the ring).
    pools_from_registry: bool = setting(False, option=False)

    def __post_init__(self) -> None:
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        for name in ("num_prefill_workers", "num_decode_workers", "num_pool_nodes", "prefill_tp", "decode_tp",
                     "num_routers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_num_kv_blocks < 0:
            raise ValueError(f"prefill_num_kv_blocks must be >= 0, got {self.prefill_num_kv_blocks}")
        http_port, grpc_port = self.router.http_port, self.router.grpc_port
        if self.num_routers > 1 and not (http_port and grpc_port):
            raise ValueError(f"num_routers={self.num_routers} needs http_port and grpc_port > 0 (router i "
                             f"listens on port + i), got {http_port} and {grpc_port}")
        http = set(range(http_port, http_port + self.num_routers))
        grpc_ports = set(range(grpc_port, grpc_port + self.num_routers))
        if self.num_routers > 1 and http & grpc_ports:
            raise ValueError(f"the routers' HTTP ports {min(http)}-{max(http)} and gRPC ports "
                             f"{min(grpc_ports)}-{max(grpc_ports)} overlap; move --http-port or --grpc-port")
        if max(http | grpc_ports) > 65535:
            raise ValueError(f"router ports run past 65535 with num_routers={self.num_routers}")
        for role in self.worker_roles:
            self.engine_config(role)  # validates what each role's workers will get
        self.router_config(self.router_names[0])

    @classmethod
    def from_options(cls, **options: Any) -> ClusterConfig:
        """The config ``tandem up`` builds from its options, by flat name (``num_kv_blocks``,
        ``routing_policy``, ``pool_capacity_bytes``, ``num_decode_workers``, ``restart``, ...);
        the rest keep their defaults. Raises ValueError naming an unknown option, or from the
        configs."""
        remaining = dict(options)
        sections = {s.attribute: s.config(**_take(s, remaining)) for s in SECTIONS}
        own = {f.name for f in dataclasses.fields(cls) if f.name not in sections}
        unknown = sorted(set(remaining) - own)
        if unknown:
            raise ValueError(f"unknown cluster option(s) {unknown}; see tandem up --help")
        return cls(**sections, **remaining)

    def with_options(self, **options: Any) -> ClusterConfig:
        """This config with some ``tandem up`` options changed (flat names, as :meth:`from_options`)."""
        remaining = dict(options)
        changes: dict[str, Any] = {}
        for s in SECTIONS:
            values = _take(s, remaining)
            if values:
                changes[s.attribute] = dataclasses.replace(getattr(self, s.attribute), **values)
        unknown = sorted(set(remaining) - {f.name for f in dataclasses.fields(self)} - {s.attribute for s in SECTIONS})
        if unknown:
            raise ValueError(f"unknown cluster option(s) {unknown}; see tandem up --help")
        return dataclasses.replace(self, **changes, **remaining)

    def options(self) -> dict[str, Any]:
        """Every ``tandem up`` option's value in this config, by flat name."""
        values: dict[str, Any] = {}
        for s in SECTIONS:
            section = getattr(self, s.attribute)
            values.update({name: getattr(section, field) for name, field in s.option_names().items()})
        values.update({f.name: getattr(self, f.name) for f in option_fields(type(self))})
        return values

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def http_port(self) -> int:
        """The first router's HTTP port."""
        return self.router.http_port

    @property
    def grpc_port(self) -> int:
        """The first router's gRPC port."""
        return self.router.grpc_port

    def engine_config(self, role: str) -> EngineConfig:
        """The engine of one ``role`` worker (prefill or decode): its KV blocks and ranks set;
        ``num_threads`` is set per process from the thread budget. Raises ValueError."""
        blocks = self.prefill_num_kv_blocks if role == "prefill" and self.prefill_num_kv_blocks else None
        return dataclasses.replace(self.engine, num_kv_blocks=blocks or self.engine.num_kv_blocks,
                                   tensor_parallel_size=self.tensor_parallel_size(role))

    def router_config(self, name: str) -> RouterConfig:
        """Router ``name``'s config: its ports, the cluster's host, the engine's model and context
        limit (secrets go through the environment, never argv). Raises ValueError."""
        http_port, grpc_port = self.router_ports(name)
        return dataclasses.replace(self.router, host=self.host, http_port=http_port, grpc_port=grpc_port,
                                   model=self.engine.model, max_model_len=self.engine.max_model_len)

    @property
    def router_names(self) -> tuple[str, ...]:
        """Service names of the routers: ``router`` alone, else ``router-0``, ``router-1``, ..."""
        return ("router",) if self.num_routers == 1 else tuple(f"router-{i}" for i in range(self.num_routers))

    def router_ports(self, name: str) -> tuple[int, int]:
        """(HTTP port, gRPC port) of router ``name``: ``http_port + i``, ``grpc_port + i``.
        Raises ValueError for a name that is not one of :attr:`router_names`."""
        if name not in self.router_names:
            raise ValueError(f"no router {name!r}; routers: {self.router_names}")
        i = self.router_names.index(name)
        return self.router.http_port + i, self.router.grpc_port + i

    def tensor_parallel_size(self, role: str) -> int:
        """Ranks of one ``role`` worker (prefill or decode)."""
        return self.prefill_tp if role == "prefill" else self.decode_tp

    def rank_threads(self, role: str, worker_threads: int) -> int:
        """Threads of each rank of a ``role`` worker given ``worker_threads`` for the whole
        worker: split between its ranks, at least 1 (TP=2 on 2 cores: 1 thread a rank)."""
        return max(1, worker_threads // self.tensor_parallel_size(role))

    @property
    def pool_names(self) -> tuple[str, ...]:
        """Service names of the pool nodes: ``kv_pool``, then ``kv_pool-1``, ..."""
        return tuple("kv_pool" if i == 0 else f"kv_pool-{i}" for i in range(self.num_pool_nodes))

    @property
    def worker_roles(self) -> tuple[str, ...]:
        return ("decode",) if self.colocated else ("prefill", "decode")

    @property
    def worker_names(self) -> tuple[tuple[str, str], ...]:
        """(service name, role) of every worker process, in start order. The first worker of a
        role is named after the role (``prefill``, ``decode``), the others ``prefill-1``, ..."""
        counts = {"prefill": self.num_prefill_workers, "decode": self.num_decode_workers}
        return tuple((role if i == 0 else f"{role}-{i}", role)
                     for role in self.worker_roles for i in range(counts[role]))


def _take(section: Section, options: dict[str, Any]) -> dict[str, Any]:
    """Pops ``section``'s options out of ``options``; returns them by field name."""
    return take(section.config, options, prefix=section.prefix, exclude=section.set_by_cluster | section.hidden)


def option_sources() -> Mapping[str, tuple[str | None, str]]:
    """Every ``tandem up`` option by flat name -> (section attribute, field name); the section is
    None for ClusterConfig's own fields. Raises ValueError when two would share a name."""
    sources: dict[str, tuple[str | None, str]] = {}
    for s in SECTIONS:
        for name, field_name in s.option_names().items():
            if name in sources:
                raise ValueError(f"option {name!r} of {s.attribute} is also {sources[name]}")
            sources[name] = (s.attribute, field_name)
    for f in option_fields(ClusterConfig):
        if f.name in sources:
            raise ValueError(f"option {f.name!r} of the cluster is also {sources[f.name]}")
        sources[f.name] = (None, f.name)
    return sources
