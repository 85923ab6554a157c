#!/usr/bin/env python3
"""Semantic checks of rendered Tandem manifests that schema validation cannot make.

``kubernetes-validate`` knows each object's shape, not how objects refer to each other. This checks
the references, in one rendering (one ``helm template`` or ``kubectl kustomize`` output) at a time:

- every Service, PodDisruptionBudget, NetworkPolicy and ServiceMonitor selector matches the pod
  labels of some workload (or Service), and the ports they name exist there;
- every HorizontalPodAutoscaler targets a workload that exists and requests what it scales on;
- every probe port exists on its container, and Tandem's services probe the gRPC health service
  they serve, on the port their flags (``TANDEM_<ROLE>_*`` env) bind;
- every env reference (ConfigMap key, ``$(VAR)``, downward-API resource) resolves;
- every volume mount, service account and StatefulSet ``serviceName`` exists;
- images are pinned to a tag and every container runs as non-root.

Usage: ``check_manifests.py FILE...`` (``-`` reads stdin); prints each problem, exits 1 if any.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

# (apiVersion, kind) pairs a Tandem rendering may contain; anything else is a typo or a drift.
KNOWN_KINDS = {
    ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"), ("v1", "ServiceAccount"),
    ("v1", "Namespace"), ("v1", "Pod"), ("v1", "PersistentVolumeClaim"),
    ("apps/v1", "Deployment"), ("apps/v1", "StatefulSet"), ("apps/v1", "DaemonSet"),
    ("autoscaling/v2", "HorizontalPodAutoscaler"), ("policy/v1", "PodDisruptionBudget"),
    # what the chart renders for clusters before 1.23 / 1.21 (Kubernetes 1.20: the local node)
    ("autoscaling/v2beta2", "HorizontalPodAutoscaler"), ("policy/v1beta1", "PodDisruptionBudget"),
    ("networking.k8s.io/v1", "NetworkPolicy"), ("networking.k8s.io/v1", "Ingress"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("rbac.authorization.k8s.io/v1", "Role"), ("rbac.authorization.k8s.io/v1", "RoleBinding"),
}
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet")

# Module run by `python -m` -> (env prefix of its flags, gRPC health service, env var of its gRPC port).
TANDEM_SERVICES = {
    "router": ("TANDEM_ROUTER_", "tandem.v1.Router", "TANDEM_ROUTER_GRPC_PORT"),
    "kv_pool": ("TANDEM_POOL_", "tandem.v1.KVPool", "TANDEM_POOL_PORT"),
    "prefill_worker": ("TANDEM_PREFILL_", "tandem.v1.PrefillWorker", "TANDEM_PREFILL_PORT"),
    "decode_worker": ("TANDEM_DECODE_", "tandem.v1.DecodeWorker", "TANDEM_DECODE_PORT"),
}
# TANDEM_* variables read outside a service's flags (core.model_source, tandem-fetch-model).
GLOBAL_TANDEM_ENV = {"TANDEM_CACHE_DIR", "TANDEM_MODEL_SOURCE", "TANDEM_MODEL_DIR",
                     # read by core.grpc_auth in every service (its CLUSTER_ENV_VARS; a test keeps them equal)
                     "TANDEM_CLUSTER_TOKEN", "TANDEM_CLUSTER_TOKEN_FILE", "TANDEM_GRPC_TLS_CERT_FILE",
                     "TANDEM_GRPC_TLS_KEY_FILE", "TANDEM_GRPC_TLS_CA_FILE", "TANDEM_GRPC_TLS_SERVER_NAME"}
VAR_REF = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
MODULE_ARG = re.compile(r"python3? -m ([a-z_]+)")


@dataclass(frozen=True)
class Obj:
    """One rendered object and where it lives."""

    raw: dict

    @property
    def kind(self) -> str:
        return self.raw.get("kind", "")

    @property
    def name(self) -> str:
        return self.raw.get("metadata", {}).get("name", "")

    @property
    def namespace(self) -> str:
        return self.raw.get("metadata", {}).get("namespace", "") or ""

    @property
    def ref(self) -> str:
        return f"{self.kind}/{self.name}"

    @property
    def spec(self) -> dict:
        return self.raw.get("spec") or {}


def load_objects(text: str) -> list[Obj]:
    """Every non-empty document of a multi-document YAML stream (``List`` kinds flattened)."""
    objects = []
    for doc in yaml.safe_load_all(text):
        if not doc:
            continue
        items = doc.get("items", []) if doc.get("kind", "").endswith("List") else [doc]
        objects.extend(Obj(item) for item in items)
    return objects


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (``matchLabels`` + ``matchExpressions``) against a label map.

    An absent selector matches nothing here (callers decide what empty means).
    """
    if not selector:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


class Rendering:
    """The objects of one rendering, indexed for lookups."""

    def __init__(self, objects: list[Obj]):
        self.objects = objects
        self.workloads = [o for o in objects if o.kind in WORKLOAD_KINDS]
        self.by_kind: dict[str, dict[tuple[str, str], Obj]] = {}
        for o in objects:
            self.by_kind.setdefault(o.kind, {})[(o.namespace, o.name)] = o

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self.by_kind.get(kind, {}).get((namespace, name))

    def pods_matching(self, namespace: str, selector: dict | None) -> list[Obj]:
        """Workloads in ``namespace`` whose pod template labels match ``selector``."""
        return [
            w for w in self.workloads
            if w.namespace == namespace and selector_matches(selector, pod_labels(w))
        ]


def pod_labels(workload: Obj) -> dict:
    return workload.spec.get("template", {}).get("metadata", {}).get("labels") or {}


def pod_spec(workload: Obj) -> dict:
    return workload.spec.get("template", {}).get("spec") or {}


def containers(workload: Obj, init: bool = True) -> list[dict]:
    spec = pod_spec(workload)
    return list(spec.get("containers") or []) + (list(spec.get("initContainers") or []) if init else [])


def container_ports(container: dict) -> tuple[set[str], set[int]]:
    ports = container.get("ports") or []
    return {p["name"] for p in ports if "name" in p}, {p["containerPort"] for p in ports}


def workload_has_port(workload: Obj, port: str | int) -> bool:
    for c in containers(workload, init=False):
        names, numbers = container_ports(c)
        if port in names or port in numbers:
            return True
    return False


# ---- the checks: each yields problems as strings ----


def check_kinds(r: Rendering) -> Iterator[str]:
    seen: set[tuple[str, str, str]] = set()
    for o in r.objects:
        if (o.raw.get("apiVersion"), o.kind) not in KNOWN_KINDS:
            yield f"{o.ref}: unexpected apiVersion/kind {o.raw.get('apiVersion')}/{o.kind}"
        key = (o.kind, o.namespace, o.name)
        if key in seen:
            yield f"{o.ref}: defined twice"
        seen.add(key)


def check_workloads(r: Rendering) -> Iterator[str]:
    for w in r.workloads:
        if not selector_matches(w.spec.get("selector"), pod_labels(w)):
            yield f"{w.ref}: spec.selector does not match its own pod template labels"
        if w.kind == "StatefulSet":
            service = r.get("Service", w.namespace, w.spec.get("serviceName", ""))
            if service is None:
                yield f"{w.ref}: serviceName {w.spec.get('serviceName')!r} is not a Service here"
            elif service.spec.get("clusterIP") != "None":
                yield f"{w.ref}: serviceName {service.name!r} should be headless (clusterIP: None)"
        account = pod_spec(w).get("serviceAccountName")
        if account and account != "default" and r.get("ServiceAccount", w.namespace, account) is None:
            yield f"{w.ref}: serviceAccountName {account!r} is not a ServiceAccount here"


def check_services(r: Rendering) -> Iterator[str]:
    for s in r.by_kind.get("Service", {}).values():
        selector = s.spec.get("selector")
        if not selector:
            yield f"{s.ref}: no selector"
            continue
        matched = r.pods_matching(s.namespace, {"matchLabels": selector})
        if not matched:
            yield f"{s.ref}: selector {selector} matches no workload's pod labels"
        for port in s.spec.get("ports") or []:
            target = port.get("targetPort", port["port"])
            for w in matched:
                if not workload_has_port(w, target):
                    yield f"{s.ref}: targetPort {target!r} is not a container port of {w.ref}"


def check_pdbs(r: Rendering) -> Iterator[str]:
    for pdb in r.by_kind.get("PodDisruptionBudget", {}).values():
        if not r.pods_matching(pdb.namespace, pdb.spec.get("selector")):
            yield f"{pdb.ref}: selector matches no workload's pod labels"


def check_network_policies(r: Rendering) -> Iterator[str]:
    for np in r.by_kind.get("NetworkPolicy", {}).values():
        selector = np.spec.get("podSelector") or {}
        targets = r.workloads if not selector else r.pods_matching(np.namespace, selector)
        targets = [w for w in targets if w.namespace == np.namespace]
        if not targets:
            yield f"{np.ref}: podSelector matches no workload's pod labels"
        for rule in np.spec.get("ingress") or []:
            for peer in rule.get("from") or []:
                if "podSelector" in peer and "namespaceSelector" not in peer:
                    if peer["podSelector"] and not r.pods_matching(np.namespace, peer["podSelector"]):
                        yield f"{np.ref}: ingress from {peer['podSelector']} matches no workload"
            for port in rule.get("ports") or []:
                if "port" in port and not any(workload_has_port(w, port["port"]) for w in targets):
                    yield f"{np.ref}: ingress port {port['port']!r} is not a container port of the selected pods"


def check_hpas(r: Rendering) -> Iterator[str]:
    for hpa in r.by_kind.get("HorizontalPodAutoscaler", {}).values():
        ref = hpa.spec.get("scaleTargetRef", {})
        target = r.get(ref.get("kind", ""), hpa.namespace, ref.get("name", ""))
        if target is None:
            yield f"{hpa.ref}: scaleTargetRef {ref.get('kind')}/{ref.get('name')} does not exist here"
            continue
        for metric in hpa.spec.get("metrics") or []:
            resource = metric.get("resource", {})
            if metric.get("type") == "Resource" and resource.get("target", {}).get("type") == "Utilization":
                for c in containers(target, init=False):
                    if resource["name"] not in (c.get("resources", {}).get("requests") or {}):
                        yield f"{hpa.ref}: scales on {resource['name']} utilization but {target.ref} " \
                              f"container {c['name']!r} requests no {resource['name']}"


def check_service_monitors(r: Rendering) -> Iterator[str]:
    services = list(r.by_kind.get("Service", {}).values())
    for sm in r.by_kind.get("ServiceMonitor", {}).values():
        matched = [s for s in services if s.namespace == sm.namespace
                   and selector_matches(sm.spec.get("selector"), s.raw["metadata"].get("labels") or {})]
        if not matched:
            yield f"{sm.ref}: selector matches no Service's labels"
        for endpoint in sm.spec.get("endpoints") or []:
            for s in matched:
                if endpoint.get("port") not in {p.get("name") for p in s.spec.get("ports") or []}:
                    yield f"{sm.ref}: endpoint port {endpoint.get('port')!r} is not a named port of {s.ref}"


def check_pods(r: Rendering) -> Iterator[str]:
    for w in r.workloads:
        spec = pod_spec(w)
        volumes = {v["name"] for v in spec.get("volumes") or []}
        volumes |= {t["metadata"]["name"] for t in w.spec.get("volumeClaimTemplates") or []}
        names = {c["name"] for c in containers(w)}
        pod_non_root = (spec.get("securityContext") or {}).get("runAsNonRoot") is True
        for c in containers(w):
            where = f"{w.ref} container {c['name']!r}"
            yield from check_container(r, w, c, where, volumes, names, pod_non_root)
        for c in spec.get("containers") or []:
            yield from check_tandem_service(c, f"{w.ref} container {c['name']!r}")


def check_container(r, w: Obj, c: dict, where: str, volumes: set, names: set, pod_non_root: bool):
    image = c.get("image", "")
    if "@" not in image and (":" not in image.rsplit("/", 1)[-1] or image.endswith(":latest")):
        yield f"{where}: image {image!r} has no pinned tag"
    if not ((c.get("securityContext") or {}).get("runAsNonRoot", pod_non_root)):
        yield f"{where}: does not run as non-root (runAsNonRoot)"
    for mount in c.get("volumeMounts") or []:
        if mount["name"] not in volumes:
            yield f"{where}: volumeMount {mount['name']!r} names no volume"
    port_names, port_numbers = container_ports(c)
    for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(probe_name) or {}
        for handler in ("httpGet", "tcpSocket", "grpc"):
            if handler in probe and probe[handler]["port"] not in port_names | port_numbers:
                yield f"{where}: {probe_name} {handler} port {probe[handler]['port']!r} is not a container port"
    defined: list[str] = []
    for env in c.get("env") or []:
        for ref in VAR_REF.findall(str(env.get("value", ""))):
            if ref not in defined:
                yield f"{where}: env {env['name']} uses $({ref}) before (or without) defining it"
        yield from check_env_source(r, w, env.get("valueFrom") or {}, f"{where} env {env['name']}", names)
        defined.append(env["name"])
    for source in c.get("envFrom") or []:
        ref = source.get("configMapRef")
        if ref and not ref.get("optional") and r.get("ConfigMap", w.namespace, ref["name"]) is None:
            yield f"{where}: envFrom ConfigMap {ref['name']!r} does not exist here"


def check_env_source(r: Rendering, w: Obj, source: dict, where: str, container_names: set[str]):
    ref = source.get("configMapKeyRef")
    if ref and not ref.get("optional"):
        cm = r.get("ConfigMap", w.namespace, ref["name"])
        if cm is None:
            yield f"{where}: ConfigMap {ref['name']!r} does not exist here"
        elif ref["key"] not in (cm.raw.get("data") or {}):
            yield f"{where}: ConfigMap {ref['name']!r} has no key {ref['key']!r}"
    ref = source.get("secretKeyRef")
    if ref and not ref.get("optional"):
        secret = r.get("Secret", w.namespace, ref["name"])  # absent: an existing Secret the user made
        if secret is not None and ref["key"] not in {**(secret.raw.get("data") or {}), **(secret.raw.get("stringData") or {})}:
            yield f"{where}: Secret {ref['name']!r} has no key {ref['key']!r}"
    field = source.get("resourceFieldRef")
    if field:
        name = field.get("containerName")
        target = next((c for c in containers(w) if c["name"] == name), None)
        if target is None:
            yield f"{where}: resourceFieldRef names no container {name!r}"
        else:
            kind, _, resource = field["resource"].partition(".")
            if resource not in ((target.get("resources") or {}).get(kind) or {}):
                yield f"{where}: reads {field['resource']} but container {name!r} sets none"


def check_tandem_service(c: dict, where: str) -> Iterator[str]:
    """A Tandem service's env prefix, health service and ports agree with its flags."""
    match = MODULE_ARG.search(" ".join(c.get("command", []) + c.get("args", [])))
    if not match or match.group(1) not in TANDEM_SERVICES:
        return
    prefix, health_service, port_env = TANDEM_SERVICES[match.group(1)]
    env = {e["name"]: e.get("value") for e in c.get("env") or []}
    for name in env:
        if name.startswith("TANDEM_") and not name.startswith(prefix) and name not in GLOBAL_TANDEM_ENV:
            yield f"{where}: env {name} is not a flag of {match.group(1)} (its prefix is {prefix})"
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
    expected = {"grpc": port_env, "http": "TANDEM_ROUTER_HTTP_PORT", "metrics": prefix + "METRICS_PORT"}
    for port_name, env_name in expected.items():
        if port_name in ports and str(ports[port_name]) != str(env.get(env_name)):
            yield f"{where}: containerPort {port_name}={ports[port_name]} but {env_name}={env.get(env_name)!r}"
    if "grpc" not in ports:
        yield f"{where}: no containerPort named grpc"
    for probe_name in ("startupProbe", "readinessProbe"):
        grpc = (c.get(probe_name) or {}).get("grpc")
        if grpc and grpc.get("service") != health_service:
            yield f"{where}: {probe_name} asks health of {grpc.get('service')!r}, not {health_service!r}"
        # The exec form (gRPC TLS, or Kubernetes < 1.24): python -m core.health_probe --port N --service S
        command = ((c.get(probe_name) or {}).get("exec") or {}).get("command") or []
        if "core.health_probe" in command:
            flags = dict(zip(command, command[1:]))
            if flags.get("--service") != health_service:
                yield f"{where}: {probe_name} execs a health check of {flags.get('--service')!r}, not {health_service!r}"
            if "grpc" in ports and flags.get("--port") != str(ports["grpc"]):
                yield f"{where}: {probe_name} execs a health check of port {flags.get('--port')}, not grpc={ports['grpc']}"
    probes = [c.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
    if not all(probes):
        yield f"{where}: needs startup, readiness and liveness probes"


CHECKS = (check_kinds, check_workloads, check_services, check_pdbs, check_network_policies,
          check_hpas, check_service_monitors, check_pods)


def check(objects: list[Obj]) -> list[str]:
    """Every problem found in one rendering."""
    rendering = Rendering(objects)
    return [problem for check_fn in CHECKS for problem in check_fn(rendering)]


def main(paths: Iterable[str]) -> int:
    failed = False
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        objects = load_objects(text)
        problems = check(objects) if objects else ["no objects rendered"]
        for problem in problems:
            print(f"{path}: {problem}")
        failed |= bool(problems)
        if not problems:
            print(f"{path}: {len(objects)} objects, references consistent")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
