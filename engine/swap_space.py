"""Where a preempted request's KV goes instead of being dropped (swap preemption, vLLM).

The scheduler frees a victim's blocks at once; the engine packs their bytes before the next step
overwrites them and hands them to a SwapSpace; when the victim is admitted again its KV comes back
as ExternalKV, so nothing is recomputed. A put that does not fit returns False and the victim is
recomputed instead (identical output either way).
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from engine.outputs import ExternalKV

log = logging.getLogger(__name__)


class SwapSpace(Protocol):
    name: str

    def put(self, request_id: str, kv: ExternalKV) -> bool:
        """Stores the KV; False when it does not fit (the caller then recomputes)."""
        ...

    def take(self, request_id: str) -> ExternalKV | None:
        """Returns and forgets the request's KV, None if it has none."""
        ...

    def discard(self, request_id: str) -> None:
        """Forgets the request's KV (it was aborted or finished). Idempotent."""
        ...


class HostSwapSpace:
    """Swap into this process's memory (on a GPU worker: host DRAM), up to ``capacity_bytes``."""

    name = "host"

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._kv: dict[str, ExternalKV] = {}

    def put(self, request_id: str, kv: ExternalKV) -> bool:
        size = sum(len(p) for p in kv.payloads)
        if self.used_bytes + size > self.capacity_bytes:
            return False
        self.discard(request_id)
        self._kv[request_id] = kv
        self.used_bytes += size
        return True

    def take(self, request_id: str) -> ExternalKV | None:
        kv = self._kv.pop(request_id, None)
        if kv is not None:
            self.used_bytes -= sum(len(p) for p in kv.payloads)
        return kv

    def discard(self, request_id: str) -> None:
        self.take(request_id)


class PoolSwapSpace:
    """Swap into the KV pool as request-scoped blocks (``<request_id>#swap``), leased until taken.

    Blocking calls on a core.pool_client.PoolClient from the engine thread: a swap moves a few
    MB over loopback/RDMA, rare next to the steps it saves.
    """

    name = "pool"

    def __init__(self, client, spec: KVCacheSpec, lease_ttl_s: float = 600.0):
        self.client = client
        self.spec = spec
        self.lease_ttl_s = lease_ttl_s
        self._num_tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def _keys(self, request_id: str, num_blocks: int) -> list[BlockKey]:
        return [BlockKey.scoped(self.spec.fingerprint, f"{request_id}#swap", i) for i in range(num_blocks)]

    def put(self, request_id: str, kv: ExternalKV) -> bool:
        keys = self._keys(request_id, len(kv.payloads))
        try:
            self.client.put_blocks(list(zip(keys, kv.payloads)), f"{request_id}#swap", self.lease_ttl_s)
        except Exception as err:  # pool full or gone: recompute instead
            log.warning("swap to the pool failed (%s); the request will be recomputed", err,
                        extra={"request_id": request_id})
            self.client.release_request(f"{request_id}#swap")
            return False
        with self._lock:
            self._num_tokens[request_id] = kv.num_tokens
        return True

    def take(self, request_id: str) -> ExternalKV | None:
        with self._lock:
            num_tokens = self._num_tokens.pop(request_id, None)
        if num_tokens is None:
            return None
        keys = self._keys(request_id, -(-num_tokens // self.spec.block_size))
        try:
            payloads = self.client.get_blocks(keys)
        except Exception as err:  # a lost swap is recomputed, never served wrong
            log.warning("swap-in from the pool failed (%s); recomputing", err, extra={"request_id": request_id})
            payloads = None
        finally:
            self.client.release_request(f"{request_id}#swap")
        return ExternalKV(num_tokens, payloads) if payloads is not None else None

    def discard(self, request_id: str) -> None:
        with self._lock:
            known = self._num_tokens.pop(request_id, None) is not None
        if known:
            self.client.release_request(f"{request_id}#swap")
