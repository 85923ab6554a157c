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

def worker_threads(cores: int, colocated: bool = False, num_prefill_workers: int = 1,
                   num_decode_workers: int = 1) -> dict[str, int]:
    """CPU threads of each prefill and each decode worker when they share a machine of ``cores``.

    Colocated: every core to the decode workers. Disaggregated: half the cores to each role,
    split between its workers, never more threads than cores: a worker's OpenMP team waits at
    every GEMM's barrier for its slowest thread, so a thread that shares its core with another
    worker stalls the whole pass. Measured on 2-core AMD EPYCs with the ShareGPT workload at
    concurrency 16 (docs/bench.md): prefill 1 + decode 2 threads on the 2 cores served 183 tok/s
    with client TBT p99 465 ms (Zen 5); prefill 1 + decode 1 served 147-207 tok/s over six runs
    (1P+1D varies that much there; about the same) with p99 123-191 ms; on Zen 4 (pinned) p99 fell from 651 to
    173 ms at equal tok/s. At least 1 each.
    """
    if colocated:
        return {"decode": max(1, cores // num_decode_workers)}
    return {"prefill": max(1, (cores // 2) // num_prefill_workers),
            "decode": max(1, (cores - cores // 2) // num_decode_workers)}


# A decode worker that shares one machine's cores with a prefill worker (engine.core_share) takes
# at most this many prompt tokens into any step (--max-mixed-prefill-tokens, scaled down while it
# runs on its own cores only; every step, as handed-over streams join at any step:
# Scheduler.decodes_may_join), unless the cluster sets its own: a whole prompt there (the router
# places one on the decode worker while the prefill worker is busy, which is when the decode worker
# has one core) stalled ~10 streams for 2-3x their usual gap, the 1P+1D TBT p99.
SHARED_CORES_MIXED_PREFILL_TOKENS = 12


def shared_threads(cores: int, threads: dict[str, int], c: ClusterConfig) -> int:
    """Threads a decode worker adds while it runs on the idle prefill workers' cores
    (engine.core_share): the cores the decode workers do not own, or 0 where sharing is off (the
    ``share_cores`` setting, colocated, or tensor-parallel workers, whose ranks' threads are fixed)."""
    if not c.share_cores or c.colocated or c.prefill_tp != 1 or c.decode_tp != 1:
        return 0
    return max(0, cores - c.num_decode_workers * threads["decode"])


def core_share_argv(c: ClusterConfig, role: str, directory: str, extra_threads: int) -> list[str]:
    """The flags by which a ``role`` worker takes part in core sharing through ``directory``
    (empty: sharing is off, no flags): the decode worker's ``extra_threads`` and, unless the
    cluster sets its own, its :data:`SHARED_CORES_MIXED_PREFILL_TOKENS`."""
    if not directory:
        return []
    argv = ["--core-share-dir", directory]
    if role == "decode":
        argv += ["--core-share-threads", str(extra_threads)]
        if not c.engine.max_mixed_prefill_tokens:
            argv += ["--max-mixed-prefill-tokens", str(SHARED_CORES_MIXED_PREFILL_TOKENS)]
    return argv


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
