"""One values file, two launchers: `helm template -f FILE` and `tandem up -f FILE` give every
service the same arguments (the ones that mean the same on both: not hosts, ports of pods,
threads or devices), and the same number of processes per role."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest

from tandem_cli.up import _prepare, up
from launcher.commands import service_argv
from tandem_cli.values import load_values, quantity_bytes
from tests.deploy.test_manifests import DEPLOY, SERVICES, env_of, helm_template, tandem_containers
from tests.deploy.test_manifests import tools  # noqa: F401  (the fixture)

LOCAL = DEPLOY / "k8s" / "helm" / "values-local.yaml"
COMPARED = {
    "router": {"model", "served-model-name", "max-model-len", "routing-policy", "disaggregation", "ttft-slo-s", "tbt-slo-s",
               "default-max-tokens", "request-timeout-s", "http-port", "grpc-port"},
    "prefill_worker": {"model", "dtype", "quantization", "block-size", "num-kv-blocks", "max-num-seqs", "max-num-batched-tokens",
                       "max-model-len", "attention-backend", "linear-backend", "kv-cache-dtype", "num-scheduler-steps",
                       "kv-transfer"},
    "kv_pool": {"capacity-bytes", "lease-ttl-s"},
}
COMPARED["decode_worker"] = COMPARED["prefill_worker"]
ROLE_OF = {"router": "router", "prefill_worker": "prefill", "decode_worker": "decode", "kv_pool": "kv_pool"}
# (values file, override flags) pairs; the flags go to tandem up and, as --set, to helm
CASES = {
    "values-local": (LOCAL, [], []),
    "values-local + overrides": (LOCAL, ["--max-num-seqs", "8", "--num-decode-workers", "2"],
                                 ["--set", "engine.maxNumSeqs=8", "--set", "decode.replicas=2"]),
    "values-local + int8": (LOCAL, ["--quantization", "int8"], ["--set", "model.quantization=int8"]),
    "values-local + fp8 KV": (LOCAL, ["--kv-cache-dtype", "fp8"], ["--set", "engine.kvCacheDtype=fp8"]),
}


def _same(a: str, b: str) -> bool:
    try:
        return float(a) == float(b)
    except ValueError:
        return a == b


def effective_flags(argv: list[str]) -> dict[str, str]:
    """Every flag's value as the service started with ``argv`` (``python -m <module> ...``)
    reads it: the argv, else its own default (the launchers pass only what differs from it)."""
    command = importlib.import_module(f"{argv[2]}.__main__").main
    params = command.make_context(argv[2], argv[3:]).params
    return {name.replace("_", "-"): str(value) for name, value in params.items()}


def chart_flags(objects: list[dict]) -> dict[str, tuple[int, dict[str, str]]]:
    """module -> (replicas, {flag: value}) from the rendered env (ConfigMap references resolved)."""
    config = next(o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config"))
    out = {}
    for o in objects:
        for module, container in tandem_containers([o]):
            prefix, env = SERVICES[module][0], env_of(container)

            def value(name: str) -> str:
                entry = env[name]
                ref = (entry.get("valueFrom") or {}).get("configMapKeyRef")
                return config["data"][ref["key"]] if ref else str(entry.get("value", ""))

            literal_or_config = [n for n in env if n.startswith(prefix) and (
                "valueFrom" not in env[n] or "configMapKeyRef" in env[n]["valueFrom"])]  # not downward API
            flags = {n[len(prefix):].lower().replace("_", "-"): value(n) for n in literal_or_config}
            if module == "kv_pool":  # the pod computes it in its shell from the memory request
                memory = quantity_bytes(container["resources"]["requests"]["memory"])
                flags["capacity-bytes"] = str(memory // 100 * int(value("POOL_ARENA_PERCENT")))
            out[module] = (o["spec"]["replicas"], flags)
    return out


def local_commands(args: list[str]) -> tuple[object, dict[str, list[dict[str, str]]]]:
    ctx = up.make_context("up", args)
    params = dict(ctx.params)
    named = [p.name for p in inspect.signature(up.callback).parameters.values() if p.kind is not p.VAR_KEYWORD]
    for name in named:  # up()'s own parameters; the rest is what _prepare reads
        params.pop(name)
    config, _, _ = _prepare(params, None, 8, False, check_ports=False)
    commands = {"kv_pool": [effective_flags(service_argv(config, "kv_pool", "python", "h", 1, "r")) for _ in config.pool_names],
                "router": [effective_flags(service_argv(config, "router", "python", "h", config.router_ports(name)[1], "r",
                                                   http_port=config.router_ports(name)[0]))
                           for name in config.router_names]}
    for _, role in config.worker_names:
        commands.setdefault(f"{role}_worker", []).append(effective_flags(service_argv(config, role, "python", "h", 1, "r")))
    return config, commands


@pytest.mark.parametrize("case", list(CASES))
def test_chart_and_tandem_up_give_each_service_the_same_arguments(tools, case) -> None:  # noqa: F811
    path, up_flags, helm_flags = CASES[case]
    chart = chart_flags(helm_template(tools, "-f", str(path), *helm_flags))
    _, local = local_commands(["-f", str(path), *up_flags])
    assert set(chart) == set(local) == set(SERVICES)
    for module, (replicas, flags) in chart.items():
        assert replicas == len(local[module]), (module, replicas, len(local[module]))
        missing = COMPARED[module] - set(flags)
        assert not missing, f"the chart sets no {sorted(missing)} on {module}"
        for process in local[module]:
            for flag in COMPARED[module]:
                assert _same(flags[flag], process[flag]), (module, flag, flags[flag], process[flag])


def test_quantization_reaches_both_workers_from_the_flag_and_the_file(tmp_path: Path) -> None:
    _, local = local_commands(["-f", str(LOCAL), "--quantization", "int8"])
    assert [p["quantization"] for p in local["prefill_worker"] + local["decode_worker"]] == ["int8", "int8"]
    values = tmp_path / "v.yaml"
    values.write_text("model: {quantization: int8}\n")
    _, local = local_commands(["-f", str(values)])
    assert {p["quantization"] for p in local["prefill_worker"] + local["decode_worker"]} == {"int8"}
    values.write_text("model: {quantization: w8a8}\n")  # the name W8A8 int8 had before it became int8
    with pytest.raises(ValueError, match=r"at /model/quantization: 'w8a8' is not one of \['none', 'int8', 'w8a16', 'fp8'\]"):
        load_values(values)


def test_flags_override_the_file_and_bad_values_are_refused_by_the_schema(tmp_path: Path) -> None:
    config, local = local_commands(["-f", str(LOCAL), "--block-size", "32"])
    assert local["decode_worker"][0]["block-size"] == "32" and local["decode_worker"][0]["max-num-seqs"] == "32"
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  blockSize: 24\n")
    with pytest.raises(ValueError, match=r"at /engine/blockSize: 24 is not one of \[16, 32, 64, 128\]"):
        load_values(bad)
    bad.write_text("kvPool:\n  dramSize: 16Gi\n")
    with pytest.raises(ValueError, match=r"Additional properties are not allowed \('dramSize' was unexpected\)"):
        load_values(bad)


def test_pool_nodes_nvme_and_colocated_from_the_file(tmp_path: Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text("prefill: {replicas: 0}\nkvPool: {replicas: 2, dram: 1Gi, arenaPercent: 50, "
                      "nvme: {type: hostPath, hostPath: /mnt/nvme, size: 10Gi, usePercent: 50}}\n")
    config, local = local_commands(["-f", str(values)])
    assert config.colocated and config.worker_roles == ("decode",)
    assert [p["capacity-bytes"] for p in local["kv_pool"]] == [str(2**30 // 100 * 50)] * 2
    assert local["kv_pool"][0]["nvme-path"] == "/mnt/nvme" and local["kv_pool"][0]["nvme-capacity-bytes"] == str(5 * 2**30)


def test_router_replicas_start_as_many_routers_on_consecutive_ports(tmp_path: Path) -> None:
    values = tmp_path / "v.yaml"
    values.write_text("router: {replicas: 2, httpPort: 9000, grpcPort: 51000}\n")
    config, local = local_commands(["-f", str(values)])
    assert config.num_routers == 2 and config.router_names == ("router-0", "router-1")
    assert [(p["http-port"], p["grpc-port"]) for p in local["router"]] == [("9000", "51000"), ("9001", "51001")]
    config, local = local_commands(["-f", str(values), "--num-routers", "3"])
    assert [p["http-port"] for p in local["router"]] == ["9000", "9001", "9002"]
