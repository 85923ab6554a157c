"""core.health_probe: the TLS-capable health check the chart's probes exec."""

from __future__ import annotations

import asyncio
from pathlib import Path

from core import grpc_service
from core.grpc_auth import ClusterSecurity
from core.grpc_service import GrpcService
from core.health_probe import check, main

TLS = Path(__file__).resolve().parents[2] / "data" / "tls"


def _tls(name: str) -> ClusterSecurity:
    return ClusterSecurity(tls_cert_pem=(TLS / f"{name}.pem").read_bytes(), tls_key_pem=(TLS / f"{name}.key").read_bytes(),
                           tls_ca_pem=(TLS / "ca.pem").read_bytes(), token="t")


async def test_probe_speaks_mtls_and_reports_the_service_status(monkeypatch) -> None:
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.KVPool"], grace_s=0, security=_tls("server"))
    port = await service.start()
    try:
        monkeypatch.setattr(grpc_service, "process_security", lambda: _tls("client"))
        assert await asyncio.to_thread(check, f"127.0.0.1:{port}", "tandem.v1.KVPool") == "SERVING"
        assert await asyncio.to_thread(check, f"127.0.0.1:{port}", "tandem.v1.Other") == "NOT_FOUND"
        assert await asyncio.to_thread(main, ["--port", str(port), "--service", "tandem.v1.KVPool"]) == 0
        monkeypatch.setattr(grpc_service, "process_security", lambda: ClusterSecurity())  # plaintext: refused
        assert await asyncio.to_thread(check, f"127.0.0.1:{port}", "", 2.0) == "UNAVAILABLE"
        assert await asyncio.to_thread(main, ["--port", str(port), "--timeout-s", "2"]) == 1
    finally:
        await service.stop()
