"""``tandem up --print-config``: the effective configuration (each option's value and where it
came from: command line, environment, values file or default) and the command of every service
it starts, as YAML. Secrets are masked."""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from launcher.commands import pool_node_args, service_argv, worker_threads
from launcher.config import ClusterConfig

SECRETS = ("api_keys", "cluster_token")


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if hasattr(value, "__fspath__"):
        return str(value)
    return value


def config_report(config: ClusterConfig, given: dict[str, tuple[Any, str]]) -> str:
    """YAML: ``options`` (name -> {value, from}) and ``services`` (name -> command line; ports
    and the private Redis are chosen at start, shown as <...>)."""
    options = {name: {"value": "<set>" if name in SECRETS and value else _plain(value), "from": source}
               for name, (value, source) in sorted(given.items())}
    redis = config.redis_url or "<private redis-server>"
    threads = worker_threads(config.num_threads or 2, config.colocated, config.num_prefill_workers,
                             config.num_decode_workers)
    pools = ",".join(f"<{name} address>" for name in config.pool_names)
    services: dict[str, list[str]] = {}
    for name in config.pool_names:
        services[name] = service_argv(config, "kv_pool", "python", config.host, 0, redis) + pool_node_args(name, config)
    for name, role in config.worker_names:
        services[name] = service_argv(config, role, "python", config.host, 0, redis, pool_address=pools,
                                      num_threads=threads[role])
    for name in config.router_names:
        http_port, grpc_port = config.router_ports(name)
        services[name] = service_argv(config, "router", "python", config.host, grpc_port, redis, http_port=http_port)
    for argv in services.values():
        for i, arg in enumerate(argv):
            if arg == "--port" and argv[i + 1] == "0":
                argv[i + 1] = "<free port>"
    commands = {name: shlex.join(argv) for name, argv in services.items()}
    return yaml.safe_dump({"options": options, "services": commands}, sort_keys=False, width=1000)
