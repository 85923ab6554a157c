"""`tandem up`: API keys reach the router and the cluster token every service through the
environment (argv, which `ps` shows, never holds them); pool and workers get a metrics port."""

from __future__ import annotations

import inspect
from pathlib import Path

from tandem_cli.up import _prepare, up
from launcher.commands import service_argv, service_env


def _config(args: list[str], env: dict[str, str] | None = None):
    ctx = up.make_context("up", args, default_map=None)
    params = dict(ctx.params)
    named = [p.name for p in inspect.signature(up.callback).parameters.values() if p.kind is not p.VAR_KEYWORD]
    for name in named:  # up()'s own parameters; the rest is what _prepare reads
        params.pop(name)
    config, _, _ = _prepare(params, None, 8, False, check_ports=False)
    return config


def test_keys_and_token_go_to_the_environment_only(tmp_path: Path, monkeypatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("from-file\n")
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.setenv("TANDEM_CLUSTER_TOKEN", "tok")
    config = _config(["--api-key", "k1", "--api-key", "k2", "--api-key-file", str(keys)])
    assert config.api_keys == ("k1", "k2", "from-file") and config.cluster_token == "tok"
    assert service_env(config, "router") == {"TANDEM_CLUSTER_TOKEN": "tok", "TANDEM_ROUTER_API_KEY": "k1 k2 from-file"}
    for role in ("kv_pool", "prefill", "decode"):
        assert service_env(config, role) == {"TANDEM_CLUSTER_TOKEN": "tok"}
        argv = service_argv(config, role, "python", "127.0.0.1", 1, "redis://x:1/0")
        assert not {"tok", "k1"} & set(argv)
    assert not {"k1", "k2", "tok"} & set(service_argv(config, "router", "python", "127.0.0.1", 1, "redis://x:1/0"))


def test_without_keys_nothing_is_added(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    monkeypatch.delenv("TANDEM_CLUSTER_TOKEN", raising=False)
    config = _config([])
    assert config.api_keys == () and config.cluster_token == ""
    assert service_env(config, "router") == {}


def test_tandem_api_key_env_holds_several(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", "a b")
    assert _config([]).api_keys == ("a", "b")


def test_pool_and_workers_get_a_metrics_port_the_router_does_not(monkeypatch) -> None:
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    config = _config([])
    for role in ("kv_pool", "prefill", "decode"):
        argv = service_argv(config, role, "python", "127.0.0.1", 1, "redis://x:1/0", metrics_port=9123)
        assert argv[argv.index("--metrics-port") + 1] == "9123", role
        assert "--metrics-port" not in service_argv(config, role, "python", "127.0.0.1", 1, "redis://x:1/0")
    assert "--metrics-port" not in service_argv(config, "router", "python", "127.0.0.1", 1, "redis://x:1/0",
                                                metrics_port=9123)
