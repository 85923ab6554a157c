"""The command line and environment of each service a cluster starts, built from ClusterConfig
(shared by the local and the Ray launcher, so both start the services with the same flags), and
how the workers share the machine's cores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from core.settings import argv
from launcher.config import SECTIONS, ClusterConfig

SERVICE_PACKAGES = {"kv_pool": "kv_pool", "prefill": "prefill_worker", "decode": "decode_worker", "router": "router"}
_SECTIONS = {s.attribute: s for s in SECTIONS}

# Up to this many cores, a 1P+1D cluster gives the decode worker every core and each prefill
# worker one thread (see worker_threads).
SMALL_MACHINE_CORES = 4


def worker_threads(cores: int, colocated: bool = False, num_prefill_workers: int = 1,
                   num_decode_workers: int = 1, share_cores: bool = True) -> dict[str, int]:
    """CPU threads of each prefill and each decode worker when they share ``cores`` cores.

    Colocated: every core to the decode workers. Disaggregated on a small machine (up to
    ``SMALL_MACHINE_CORES``), when there is one decode worker: it gets every core, and each
    prefill worker one thread. Decode is the latency-critical, always-running role; a
    single-threaded prefill opens no OpenMP team, so it only takes time slices from decode and
    never stalls at a barrier, where two multi-threaded workers sharing cores collapse (2 cores,
    ShareGPT at concurrency 16: prefill 1 + decode 2 threads served 164 tok/s, 1 + 1 served 125,
    2 + 2 served 62; docs/bench.md). Otherwise, or without ``share_cores`` (Ray reserves each
    worker's threads as CPUs), half the cores to each role, never shared. At least 1 each.
    """
    if colocated:
        return {"decode": max(1, cores // num_decode_workers)}
    if share_cores and cores <= SMALL_MACHINE_CORES and num_decode_workers == 1:
        return {"prefill": 1, "decode": cores}
    return {"prefill": max(1, (cores // 2) // num_prefill_workers),
            "decode": max(1, (cores - cores // 2) // num_decode_workers)}


def section_argv(attribute: str, config: object, extra: tuple[str, ...] = ()) -> list[str]:
    """The flags giving a service the cluster's settings of one section (``engine``, ``worker``,
    ``router``, ``pool``): each ``tandem up`` option of it (and ``extra`` or hidden field) whose
    value differs from the default, by the service's own flag name. A setting left at its
    default is not passed: the service's default is the same declaration (and its
    ``TANDEM_<ROLE>_<FLAG>`` environment variable may still set it)."""
    section = _SECTIONS[attribute]
    return argv(config, names=[*section.option_names().values(), *extra, *section.hidden])


def service_argv(c: ClusterConfig, role: str, python: str, host: str, port: int, redis_url: str, *,
                 pool_address: str = "", num_threads: int = 1, metrics_port: int = 0, http_port: int = 0) -> list[str]:
    """``python -m <package> <flags>`` of one service (role: kv_pool, prefill, decode, router).

    ``port`` is the gRPC port (a router's HTTP port is ``http_port``, 0: the config's);
    ``metrics_port``: where a pool or worker serves ``/metrics`` (0: off; the router serves it on
    its HTTP port); ``pool_address``: the workers' pool nodes, comma-separated; ``num_threads``:
    the whole worker's, its tensor-parallel ranks split it (``ClusterConfig.rank_threads``).
    Raises ValueError for an unknown role.
    """
    if role not in SERVICE_PACKAGES:
        raise ValueError(f"unknown service role {role!r}")
    common = [python, "-m", SERVICE_PACKAGES[role], "--host", host, "--redis-url", redis_url]
    if metrics_port and role != "router":
        common += ["--metrics-port", str(metrics_port)]
    if role == "kv_pool":
        return [*common, "--port", str(port), *section_argv("pool", c.pool)]
    if role == "router":
        router = dataclasses.replace(c.router_config(c.router_names[0]), http_port=http_port or c.http_port,
                                     grpc_port=port)
        return [*common, *section_argv("router", router, extra=("model", "max_model_len"))]
    engine = c.engine_config(role)
    return [
        *common, "--port", str(port), "--pool-address", "" if c.pools_from_registry else pool_address,
        *section_argv("worker", c.worker), *section_argv("engine", engine),
        "--num-threads", str(c.rank_threads(role, num_threads)),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
    ]


def service_env(c: ClusterConfig, role: str) -> dict[str, str]:
    """Environment variables of one service beyond the launcher's own: its secrets."""
    env = {"TANDEM_CLUSTER_TOKEN": c.cluster_token} if c.cluster_token else {}
    if role == "router" and c.api_keys:
        env["TANDEM_ROUTER_API_KEY"] = " ".join(c.api_keys)
    return env


def pool_node_args(name: str, c: ClusterConfig) -> list[str]:
    """What sets pool node ``name`` apart when several share this host: its id and, with an NVMe
    tier, a folder of its own under the pool's ``nvme_path`` (a repeated flag: the last one counts)."""
    if c.num_pool_nodes == 1:
        return []
    index = name.removeprefix("kv_pool").lstrip("-") or "0"
    args = ["--node-id", f"pool-{index}"]
    if c.pool.nvme_path:
        args += ["--nvme-path", str(Path(c.pool.nvme_path) / f"pool-{index}")]
    return args
