"""``python -m core.health_probe --port N [--service NAME]``: a ``grpc.health.v1`` check of a
Tandem server on this host, with the cluster's TLS credentials (core.grpc_auth) — for
Kubernetes probes when gRPC TLS is on, which kubelet's own gRPC probe cannot speak.

Exit status 0 when the service reports SERVING, 1 otherwise (the reason on stderr).
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.grpc_service import cluster_channel


def check(address: str, service: str = "", timeout_s: float = 4.0) -> str:
    """The health status name of ``service`` at ``address`` ("SERVING", "NOT_SERVING", ...), or
    the gRPC status code name of a failed call ("UNAVAILABLE", ...)."""
    with cluster_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as err:
            return err.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--service", default="")
    parser.add_argument("--timeout-s", type=float, default=4.0)
    args = parser.parse_args(argv)
    status = check(f"{args.host}:{args.port}", args.service, args.timeout_s)
    if status != "SERVING":
        print(f"{args.service or 'server'} on {args.host}:{args.port}: {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
