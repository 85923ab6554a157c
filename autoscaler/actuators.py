"""Where scaling decisions take effect: local worker processes, or Kubernetes Deployments.

An actuator knows how many workers of a role it has asked for (``replicas``) and changes that
(``scale``). Scale-down is a drain in both: the worker gets SIGTERM, deregisters from Redis first
(no new placements), lets its in-flight RPCs and streams finish within its grace period, then
exits (worker.runtime.serve_worker; the chart's terminationGracePeriodSeconds).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

import httpx


class Actuator(Protocol):
    def replicas(self, role: str) -> int:
        """Workers of ``role`` asked for (running or starting)."""
        ...

    def scale(self, role: str, replicas: int) -> None:
        """Starts or drains workers of ``role`` until ``replicas`` are asked for."""
        ...


class LocalActuator:
    """Workers of a launcher.local_cluster.LocalCluster (``add_worker`` / ``remove_worker``)."""

    def __init__(self, cluster):
        self.cluster = cluster

    def replicas(self, role: str) -> int:
        return len(self.cluster.worker_services(role))

    def scale(self, role: str, replicas: int) -> None:
        while self.replicas(role) < replicas:
            self.cluster.add_worker(role)
        while self.replicas(role) > replicas:
            self.cluster.remove_worker(role)


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class KubernetesActuator:
    """Scales two Deployments through the API server's ``deployments/scale`` subresource with the
    pod's ServiceAccount token (the chart's Role grants get/patch on exactly these two)."""

    def __init__(self, deployments: dict[str, str], namespace: str = "", api_url: str = "",
                 token_path: Path = SERVICE_ACCOUNT_DIR / "token", ca_path: Path = SERVICE_ACCOUNT_DIR / "ca.crt",
                 client: httpx.Client | None = None):
        self.deployments = deployments  # role -> Deployment name
        self.namespace = namespace or (SERVICE_ACCOUNT_DIR / "namespace").read_text().strip()
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        self.api_url = api_url or f"https://{host}:{port}"
        self._token_path = token_path
        self._client = client or httpx.Client(verify=str(ca_path) if ca_path.exists() else True, timeout=10.0)

    def _url(self, role: str) -> str:
        return (f"{self.api_url}/apis/apps/v1/namespaces/{self.namespace}/deployments/"
                f"{self.deployments[role]}/scale")

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token_path.read_text().strip()}"}  # re-read: tokens rotate

    def replicas(self, role: str) -> int:
        if role not in self.deployments:
            return 0
        response = self._client.get(self._url(role), headers=self._headers())
        response.raise_for_status()
        return int(response.json()["spec"].get("replicas", 0))

    def scale(self, role: str, replicas: int) -> None:
        if role not in self.deployments:
            return
        response = self._client.patch(self._url(role), json={"spec": {"replicas": replicas}},
                                      headers={**self._headers(), "Content-Type": "application/merge-patch+json"})
        response.raise_for_status()
