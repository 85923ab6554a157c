"""The local Kubernetes node and the Tandem release on it, as the proofs drive them: kubectl and
helm as subprocesses (the node's own kubectl 1.20), the workers' GetStats over their pod IPs
(pods are network namespaces on this machine's bridge).

Settings (the defaults of deploy/tools/k8s-local): TANDEM_K8S_STATE_DIR, TANDEM_K8S_NAMESPACE,
TANDEM_K8S_RELEASE, TANDEM_K8S_TOOLS or TANDEM_K8S_HELM (helm), TANDEM_K8S_URL (the router's NodePort).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import grpc
import httpx

from tandem.v1 import decode_worker_pb2_grpc, prefill_worker_pb2, prefill_worker_pb2_grpc
from tests.conftest import poll_until

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "k8s" / "helm" / "tandem"
VALUES = REPO / "deploy" / "k8s" / "helm" / "values-single-node-cpu.yaml"
WORKER_PORTS = {"prefill": 50061, "decode": 50071}


def _timestamp_s(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@dataclass
class Pod:
    name: str
    ip: str
    created_s: float  # creationTimestamp, seconds since the epoch (1 s resolution)
    ready_s: float | None  # when the Ready condition last became True; None while not Ready
    deleting: bool  # a deletionTimestamp is set: terminating

    @classmethod
    def of(cls, obj: dict) -> Pod:
        ready = [c for c in obj["status"].get("conditions", []) if c["type"] == "Ready" and c["status"] == "True"]
        return cls(obj["metadata"]["name"], obj["status"].get("podIP", ""),
                   _timestamp_s(obj["metadata"]["creationTimestamp"]),
                   _timestamp_s(ready[0]["lastTransitionTime"]) if ready else None,
                   "deletionTimestamp" in obj["metadata"])

    @property
    def time_to_ready_s(self) -> float | None:
        return None if self.ready_s is None else self.ready_s - self.created_s


class Node:
    """The node's API (kubectl, helm) and the release's router, workers and Deployments."""

    def __init__(self):
        state = Path(os.environ.get("TANDEM_K8S_STATE_DIR", "/var/lib/tandem-k8s"))
        self.kubectl_bin = state / "bin" / "kubectl"
        self.kubeconfig = state / "pki" / "admin.kubeconfig"
        tools = Path(os.environ.get("TANDEM_K8S_TOOLS", REPO / ".cache" / "k8s-tools"))
        self.helm_bin = Path(os.environ.get("TANDEM_K8S_HELM", tools / "bin" / "helm"))
        self.namespace = os.environ.get("TANDEM_K8S_NAMESPACE", "tandem")
        self.release = os.environ.get("TANDEM_K8S_RELEASE", "tandem")
        self.url = os.environ.get("TANDEM_K8S_URL", "http://127.0.0.1:30080")
        self._deployments: dict[str, str] = {}

    # --- kubectl and helm -------------------------------------------------------------------

    def kubectl(self, *args: str, timeout_s: float = 120) -> str:
        """kubectl's stdout; raises CalledProcessError (with stderr) when it fails."""
        result = subprocess.run([str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig), "-n", self.namespace,
                                 *args], capture_output=True, text=True, timeout=timeout_s)
        if result.returncode:
            raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
        return result.stdout

    def kubectl_json(self, *args: str) -> dict:
        return json.loads(self.kubectl(*args, "-o", "json"))

    def helm(self, *args: str, timeout_s: float = 900) -> str:
        result = subprocess.run([str(self.helm_bin), "--kubeconfig", str(self.kubeconfig), "-n", self.namespace,
                                 *args], capture_output=True, text=True, timeout=timeout_s)
        if result.returncode:
            raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
        return result.stdout

    def helm_upgrade(self, *set_args: str) -> None:
        """``helm upgrade --reuse-values --set ...`` of the release, waiting for every rollout."""
        args = [a for pair in (("--set", s) for s in set_args) for a in pair]
        self.helm("upgrade", self.release, str(CHART), "--reuse-values", *args, "--wait", "--timeout", "15m")

    def revision(self) -> int:
        return json.loads(self.helm("status", self.release, "-o", "json"))["version"]

    # --- objects ----------------------------------------------------------------------------

    def selector(self, component: str) -> str:
        return f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component={component}"

    def deployment(self, component: str) -> str:
        """The name of the release's Deployment of ``component``, found by its labels (the chart's
        fullname is the release name alone when that already contains "tandem")."""
        if component not in self._deployments:
            (obj,) = self.kubectl_json("get", "deployments", "-l", self.selector(component))["items"]
            self._deployments[component] = obj["metadata"]["name"]
        return self._deployments[component]

    def pods(self, component: str) -> list[Pod]:
        return [Pod.of(o) for o in self.kubectl_json("get", "pods", "-l", self.selector(component))["items"]]

    def replicas(self, component: str) -> int:
        return self.kubectl_json("get", "deployment", self.deployment(component))["spec"].get("replicas", 0)

    def scale(self, component: str, replicas: int) -> None:
        self.kubectl("scale", f"deployment/{self.deployment(component)}", f"--replicas={replicas}")

    def delete_pod(self, name: str) -> None:
        """``kubectl delete pod`` (graceful: preStop, SIGTERM, the grace period), not waiting."""
        self.kubectl("delete", "pod", name, "--wait=false")

    def rollout_status(self, component: str, timeout_s: float = 600) -> None:
        self.kubectl("rollout", "status", f"deployment/{self.deployment(component)}", f"--timeout={int(timeout_s)}s",
                     timeout_s=timeout_s + 10)

    # --- the router and the workers ---------------------------------------------------------

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def registered(self, role: str) -> int:
        """Workers of ``role`` the router sees (its /health counts)."""
        return self.health().get("workers", {}).get(role, 0)

    def worker_stats(self, role: str, pod: Pod, timeout_s: float = 10):
        """GetStats of the worker in ``pod`` (its gRPC port on the pod IP)."""
        stub_type = prefill_worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else decode_worker_pb2_grpc.DecodeWorkerStub
        with grpc.insecure_channel(f"{pod.ip}:{WORKER_PORTS[role]}") as channel:
            return stub_type(channel).GetStats(prefill_worker_pb2.GetWorkerStatsRequest(), timeout=timeout_s)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples on the router's /metrics."""
        body = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name) and not line.startswith("#"))

    def wait_serving(self, prefill: int = 1, decode: int = 1, timeout_s: float = 600) -> None:
        """Until exactly these workers run (Ready, none terminating) and the router sees them."""
        def settled() -> bool:
            for role, want in (("prefill", prefill), ("decode", decode)):
                pods = self.pods(role)
                if len(pods) != want or any(p.deleting or p.ready_s is None for p in pods):
                    return False
                if self.registered(role) != want:
                    return False
            return True
        poll_until(settled, timeout_s=timeout_s, interval_s=1.0, message=f"{prefill} prefill + {decode} decode serving")

    def wait_pod_gone(self, component: str, name: str, timeout_s: float = 300) -> float:
        """Waits until pod ``name`` no longer exists; returns when (time.time())."""
        poll_until(lambda: name not in {p.name for p in self.pods(component)}, timeout_s=timeout_s,
                   interval_s=0.5, message=f"pod {name} gone")
        return time.time()
