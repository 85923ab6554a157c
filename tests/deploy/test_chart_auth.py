"""The chart's access control (values-secure.yaml): API keys on the router, the cluster token
and gRPC TLS on every service, probes that speak TLS, and NetworkPolicies unchanged."""

from __future__ import annotations

import os
import subprocess

import pytest

from core.grpc_auth import CLUSTER_ENV_VARS
from tests.deploy.test_manifests import DEPLOY, SECURE, check_manifests, env_of, helm_template, tandem_containers
from tests.deploy.test_manifests import tools  # noqa: F401  (the fixture)

HEALTH = {"kv_pool": "tandem.v1.KVPool", "prefill_worker": "tandem.v1.PrefillWorker",
          "decode_worker": "tandem.v1.DecodeWorker"}


@pytest.fixture(scope="module")
def secure(tools):
    return helm_template(tools, "-f", str(SECURE))


@pytest.fixture(scope="module")
def default(tools):
    return helm_template(tools)


def _pod(objects, module):
    """(pod spec, container) of the one workload running ``module``."""
    for o in objects:
        for found, container in tandem_containers([o]):
            if found == module:
                return o["spec"]["template"]["spec"], container
    raise AssertionError(f"no {module} pod")


def test_the_checker_knows_every_variable_core_grpc_auth_reads() -> None:
    assert set(CLUSTER_ENV_VARS) <= check_manifests.GLOBAL_TANDEM_ENV


def test_every_service_gets_the_token_secret_and_the_tls_files(secure) -> None:
    token_secret = next(o for o in secure if o["kind"] == "Secret" and o["metadata"]["name"].endswith("cluster-token"))
    assert set(token_secret["data"]) == {"token"} and len(token_secret["data"]["token"]) == 64  # 48 chars, base64
    for module in ("router", *HEALTH):
        pod, container = _pod(secure, module)
        env = env_of(container)
        ref = env["TANDEM_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (token_secret["metadata"]["name"], "token"), module
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert mounts["grpc-tls"] == "/etc/tandem/tls" and volumes["grpc-tls"]["secret"]["secretName"] == "tandem-grpc-tls"
        assert {env[f"TANDEM_GRPC_TLS_{k}_FILE"]["value"] for k in ("CERT", "KEY", "CA")} == {
            "/etc/tandem/tls/tls.crt", "/etc/tandem/tls/tls.key", "/etc/tandem/tls/ca.crt"}
        assert env["TANDEM_GRPC_TLS_SERVER_NAME"]["value"] == "tandem-internal"


def test_the_router_reads_the_api_keys_from_the_mounted_secret(secure, default) -> None:
    pod, container = _pod(secure, "router")
    env = env_of(container)
    mount = next(m for m in container["volumeMounts"] if m["name"] == "api-keys")
    assert env["TANDEM_ROUTER_API_KEY_FILE"]["value"] == mount["mountPath"] + "/api-keys"
    assert next(v for v in pod["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "tandem-api-keys"
    assert env["TANDEM_ROUTER_OPEN_PATHS"]["value"] == "/health,/metrics"
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"  # open: probes send no key
    _, plain = _pod(default, "router")
    assert not {"TANDEM_ROUTER_API_KEY_FILE", "TANDEM_CLUSTER_TOKEN"} & set(env_of(plain))


def test_with_tls_the_grpc_probes_exec_the_tls_health_check(secure, default) -> None:
    for module, service in HEALTH.items():
        _, container = _pod(secure, module)
        port = str(next(p["containerPort"] for p in container["ports"] if p["name"] == "grpc"))
        base = ["python", "-m", "core.health_probe", "--port", port]
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["exec"]["command"] == [*base, "--service", service], (module, probe)
            assert "grpc" not in container[probe]
        assert container["livenessProbe"]["exec"]["command"] == base
        _, plain = _pod(default, module)
        assert plain["readinessProbe"]["grpc"] == {"port": int(port), "service": service}


def test_network_policies_are_the_same_with_access_control_on(secure, default) -> None:
    def policies(objects):
        return sorted((o["metadata"]["name"], repr(o["spec"])) for o in objects if o["kind"] == "NetworkPolicy")

    assert policies(secure) == policies(default) and policies(default)


def test_an_otlp_endpoint_reaches_every_service(tools) -> None:  # noqa: F811
    objects = helm_template(tools, "--set", "tracing.otlpEndpoint=http://otel-collector.monitoring:4317")
    modules = set()
    for module, container in tandem_containers(objects):
        assert env_of(container)["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.monitoring:4317"
        modules.add(module)
    assert modules == {"router", *HEALTH}
    assert all("OTEL_EXPORTER_OTLP_ENDPOINT" not in env_of(c) for _, c in tandem_containers(helm_template(tools)))


def test_the_kustomize_auth_component_wires_the_same_secrets(tools, tmp_path) -> None:  # noqa: F811
    k8s = DEPLOY / "k8s"
    (tmp_path / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: tandem\n"
        f"resources:\n  - {os.path.relpath(k8s / 'base', tmp_path)}\n"
        f"components:\n  - {os.path.relpath(k8s / 'components' / 'auth', tmp_path)}\n")
    result = subprocess.run([str(tools / "kubectl"), "kustomize", str(tmp_path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    objects = [o.raw for o in check_manifests.load_objects(result.stdout)]
    assert check_manifests.check([check_manifests.Obj(o) for o in objects]) == []
    modules = set()
    for module, container in tandem_containers(objects):
        ref = env_of(container)["TANDEM_CLUSTER_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("tandem-cluster-token", "token")
        modules.add(module)
    assert modules == {"router", *HEALTH}
    pod, router = _pod(objects, "router")
    assert env_of(router)["TANDEM_ROUTER_API_KEY_FILE"]["value"] == "/etc/tandem/api-keys/api-keys"
    assert {"name": "api-keys", "mountPath": "/etc/tandem/api-keys", "readOnly": True} in router["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "tandem-api-keys"
