"""Each cluster setting is declared once, in its service's config: `tandem up` with no flags is
ClusterConfig(), the argv a launcher hands a service parses back into the config it meant, and
the Helm values mapping names real settings with the values they accept."""

from __future__ import annotations

import dataclasses

import click
import pytest

from core.settings import option_fields
from engine.config import EngineConfig
from kv_pool.config import PoolConfig
from launcher.commands import service_argv
from launcher.config import SECTIONS, ClusterConfig, option_sources
from router.config import RouterConfig
from tandem_cli.up import _prepare, up
from tandem_cli.values import MAPPING, load_values, up_options
from worker.config import WorkerConfig


def _up_params(args: list[str], default_map: dict | None = None) -> dict:
    ctx = up.make_context("up", args, default_map=default_map)
    names = set(option_sources()) | {"api_keys", "api_key_file", "cluster_token", "restart"}
    return {k: v for k, v in ctx.params.items() if k in names}


def test_tandem_up_without_flags_is_the_default_config(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_CLUSTER_TOKEN", raising=False)
    config, _, _ = _prepare(_up_params([]), None, 8, False, check_ports=False)
    assert config == ClusterConfig()
    assert config.engine == EngineConfig() and config.router == RouterConfig() and config.pool == PoolConfig()


def test_every_option_of_tandem_up_comes_from_one_config_field() -> None:
    sources = option_sources()  # raises if two sections would share an option name
    assert sources["num_kv_blocks"] == ("engine", "num_kv_blocks")
    assert sources["pool_capacity_bytes"] == ("pool", "capacity_bytes")
    assert sources["kv_transfer"] == ("worker", "kv_transfer")
    assert sources["routing_policy"] == ("router", "routing_policy")
    assert sources["num_decode_workers"] == (None, "num_decode_workers")
    params = {p.name for p in up.params}
    assert set(sources) <= params
    for section in SECTIONS:  # what the cluster sets per process is no option
        for name in section.set_by_cluster:
            assert (section.attribute, name) not in sources.values()


def test_from_options_refuses_an_unknown_name_and_with_options_changes_one_section() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster option\(s\) \['num_kv_block'\]"):
        ClusterConfig.from_options(num_kv_block=8)
    config = ClusterConfig.from_options(num_kv_blocks=256, routing_policy="round_robin", pool_capacity_bytes=2**28)
    assert (config.engine.num_kv_blocks, config.router.routing_policy, config.pool.capacity_bytes) == (
        256, "round_robin", 2**28)
    assert config.with_options(kv_transfer="grpc").worker == WorkerConfig(kv_transfer="grpc")
    assert config.options()["pool_capacity_bytes"] == 2**28


def _parse(command: click.Command, argv: list[str]) -> dict:
    """The parameters ``command`` gets from ``argv`` (``python -m <package>`` stripped)."""
    return command.make_context(command.name or "main", argv[3:]).params


def test_each_service_reads_back_the_config_the_cluster_meant() -> None:
    from decode_worker.__main__ import main as decode_main
    from kv_pool.__main__ import main as pool_main
    from router.__main__ import main as router_main

    config = ClusterConfig.from_options(
        num_kv_blocks=300, prefill_num_kv_blocks=200, block_size=32, enforce_eager=False, routing_policy="cache_aware",
        served_model_name="m", open_paths=("/health",), pool_capacity_bytes=2**28, pool_nvme_path="/tmp/nvme",
        kv_transfer="grpc", kv_lease_ttl_s=5.0, decode_tp=2, http_port=9000, grpc_port=9100, host="0.0.0.0")
    pool = _parse(pool_main, service_argv(config, "kv_pool", "python", "0.0.0.0", 7000, "redis://r:1/0"))
    pool.pop("log_level")
    assert PoolConfig(**pool) == dataclasses.replace(config.pool, host="0.0.0.0", port=7000, redis_url="redis://r:1/0")
    router = _parse(router_main, service_argv(config, "router", "python", "0.0.0.0", 9100, "redis://r:1/0"))
    for name in ("log_level", "api_keys", "api_key_file"):
        router.pop(name)
    assert RouterConfig(**router) == dataclasses.replace(config.router_config("router"), redis_url="redis://r:1/0",
                                                         api_keys=())
    decode = _parse(decode_main, service_argv(config, "decode", "python", "0.0.0.0", 7001, "redis://r:1/0",
                                              pool_address="p:1", num_threads=4))
    engine = EngineConfig(**{f.name: decode.pop(f.name) for f in option_fields(EngineConfig)})
    assert engine == dataclasses.replace(config.engine_config("decode"), num_threads=2)  # 4 threads, 2 ranks
    assert engine.num_kv_blocks == 300 and config.engine_config("prefill").num_kv_blocks == 200
    assert WorkerConfig(**decode) == dataclasses.replace(config.worker, host="0.0.0.0", port=7001,
                                                         redis_url="redis://r:1/0", pool_address="p:1")


def test_a_changed_hidden_worker_setting_reaches_the_workers_only_when_changed() -> None:
    config = ClusterConfig()
    assert "--log-level" not in service_argv(config, "decode", "python", "h", 1, "r")
    debug = dataclasses.replace(config, worker=WorkerConfig(log_level="DEBUG"))
    argv = service_argv(debug, "decode", "python", "h", 1, "r")
    assert argv[argv.index("--log-level") + 1] == "DEBUG"


def test_the_helm_mapping_names_tandem_up_options_and_the_chart_values_fit_them() -> None:
    params = {p.name: p for p in up.params}
    assert set(MAPPING) <= set(params), sorted(set(MAPPING) - set(params))
    options = up_options(load_values_defaults())
    for name, value in options.items():  # the chart's own defaults are values the options accept
        param = params[name]
        if isinstance(param.type, click.Choice):
            assert value in param.type.choices, (name, value, param.type.choices)
    config, _, _ = _prepare(_up_params([], default_map=options), None, 8, False, check_ports=False)
    assert (config.engine.num_kv_blocks, config.num_routers, config.router.open_paths) == (16384, 2, ("/health", "/metrics"))
    assert config.worker.kv_lease_ttl_s == WorkerConfig().kv_lease_ttl_s == 60.0  # transfer.kvLeaseTtlS


def load_values_defaults() -> dict:
    """The chart's values.yaml, merged and validated as ``tandem up -f`` reads a file."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        empty = Path(folder) / "values.yaml"
        empty.write_text("{}\n")
        return load_values(empty)
