"""Readiness probes of the services, as the launchers poll them: each a ``() -> bool`` that is
True once the service answers (never raises)."""

from __future__ import annotations

import socket
from collections.abc import Callable

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.grpc_service import cluster_channel


def grpc_ready(address: str) -> Callable[[], bool]:
    """``grpc.health.v1`` at ``address`` (host:port) says SERVING (pool nodes and workers)."""
    def check() -> bool:
        with cluster_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING

    return check


def http_ready(url: str) -> Callable[[], bool]:
    """GET ``url`` answers 200 (a router's ``/health``)."""
    def check() -> bool:
        try:
            return httpx.get(url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def router_sees(url: str, num_prefill: int, num_decode: int) -> Callable[[], bool]:
    """GET ``url`` (a router's ``/health``) answers 200 and counts at least ``num_prefill`` prefill
    and ``num_decode`` decode workers: the router started beside the workers has read them all
    from the registry, so no first request is placed without one of them."""
    def check() -> bool:
        try:
            reply = httpx.get(url, timeout=1.0)
            workers = reply.json().get("workers", {}) if reply.status_code == 200 else {}
        except (httpx.HTTPError, ValueError):
            return False
        return workers.get("prefill", 0) >= num_prefill and workers.get("decode", 0) >= num_decode

    return check


def redis_ready(port: int, host: str = "127.0.0.1") -> Callable[[], bool]:
    """A Redis at ``host:port`` answers PING."""
    def check() -> bool:
        try:
            with socket.create_connection((host, port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    return check
