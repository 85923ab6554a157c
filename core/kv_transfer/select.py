"""Choosing a transfer backend per pool node: ``--kv-transfer {auto,grpc,shm,nixl}``.

auto: shared memory when the pool's arena is a file on this host, else NIXL when the package is
importable and the pool runs an agent, else gRPC (works anywhere).
"""

from __future__ import annotations

import logging

from core.kv_transfer.backend import TransferBackend
from core.kv_transfer.grpc_backend import GrpcBackend
from core.kv_transfer.shm_backend import ShmBackend
from core.pool_client import PoolClient

log = logging.getLogger(__name__)

TRANSFER_MODES = ("auto", "grpc", "shm", "nixl")


def connect(mode: str, client: PoolClient) -> TransferBackend:
    """The backend ``mode`` names (auto: the best one that works) for ``client``'s pool node.

    Raises:
        ValueError: an unknown mode, or a named backend this pool cannot be reached with.
        grpc.RpcError: the pool did not answer GetDataPlane.
    """
    if mode not in TRANSFER_MODES:
        raise ValueError(f"kv transfer must be one of {TRANSFER_MODES}, got {mode!r}")
    if mode == "grpc":
        return GrpcBackend(client)
    if mode in ("auto", "shm") and ShmBackend.available(client):
        return ShmBackend(client)
    if mode == "shm":
        raise ValueError(f"pool {client.address} has no shared-memory arena on this host")
    if mode in ("auto", "nixl"):
        backend = _nixl(client, required=mode == "nixl")
        if backend is not None:
            return backend
    return GrpcBackend(client)


def _nixl(client: PoolClient, required: bool) -> TransferBackend | None:
    try:
        from core.kv_transfer.nixl_backend import NixlBackend
    except ImportError as err:
        if required:
            raise ValueError(f"kv transfer nixl needs the nixl package: {err}") from err
        return None
    plane = client.data_plane()
    if not plane.nixl_agent_metadata:
        if required:
            raise ValueError(f"pool {client.address} runs no NIXL agent (start it with --nixl on)")
        return None
    try:
        return NixlBackend(client, plane)
    except Exception as err:  # UCX could not reach the pool's agent
        if required:
            raise ValueError(f"NIXL connection to pool {client.address} failed: {err}") from err
        log.warning("NIXL unavailable for pool %s, using gRPC", client.address, exc_info=True)
        return None
