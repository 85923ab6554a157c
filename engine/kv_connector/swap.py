"""Where a preempted request's KV goes instead of being dropped (swap preemption, vLLM).

The scheduler frees a victim's blocks at once and lists them in ``SchedulerOutput.swap_outs``;
the engine packs their bytes before the next step overwrites them and puts them here; before a
later ``schedule()`` the engine takes them back (:meth:`LLMEngine._swap_in`) and hands them to the
scheduler as ExternalKV, so nothing is recomputed and ``schedule()`` itself never waits on I/O.
A put that does not fit returns False and the victim is recomputed instead (identical output
either way).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Protocol

import grpc

from core.block_key import BlockKey
from core.pool_ring import HashRing
from engine.kv_connector.load_failure import KVLoadError
from engine.outputs import ExternalKV

if TYPE_CHECKING:
    from engine.kv_connector.pool_io import PoolIO

log = logging.getLogger(__name__)


class SwapSpace(Protocol):
    name: str

    def put(self, request_id: str, kv: ExternalKV) -> bool:
        """Stores the KV; False when it does not fit (the caller then recomputes)."""
        ...

    def take(self, request_id: str) -> ExternalKV | None:
        """Returns and forgets the request's KV, None if it has none (or it was lost)."""
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


def swap_owner_id(request_id: str) -> str:
    """The pool request id that holds a swapped request's blocks (apart from the request's own
    leases, which another component may release)."""
    return f"{request_id}#swap"


class PoolSwapSpace:
    """Swap into the KV pool as request-scoped blocks (``<request_id>#swap``), spread over the
    pool's ring and checksummed like every other pool write (:class:`PoolIO`), leased until taken.

    Blocking calls from the engine thread, outside ``schedule()``: a swap moves a few MB over
    loopback/RDMA, rare next to the steps it saves. A node that fails a put loses only its share
    (PoolIO logs it); at swap-in any block that comes back short (a node died, a checksum failed)
    makes the whole swap-in fail: the request is recomputed, never served wrong KV.
    """

    name = "pool"

    def __init__(self, io: PoolIO, ring: HashRing, lease_ttl_s: float = 600.0):
        self.io = io
        self.ring = ring
        self.lease_ttl_s = lease_ttl_s
        self._num_tokens: dict[str, int] = {}
        self._lock = threading.Lock()

    def _keys(self, request_id: str, num_blocks: int) -> list[BlockKey]:
        fp = self.io.spec.fingerprint
        return [BlockKey.scoped(fp, swap_owner_id(request_id), i) for i in range(num_blocks)]

    def put(self, request_id: str, kv: ExternalKV) -> bool:
        owner = swap_owner_id(request_id)
        try:
            self.io.store_now(self.ring, owner, self._keys(request_id, len(kv.payloads)), list(kv.payloads),
                              lease_ttl_s=self.lease_ttl_s)
        except (grpc.RpcError, OSError) as err:  # pool full or gone: recompute instead
            log.warning("swap to the pool failed (%s); the request will be recomputed", err,
                        extra={"request_id": request_id})
            self._release(owner)
            return False
        with self._lock:
            self._num_tokens[request_id] = kv.num_tokens
        return True

    def take(self, request_id: str) -> ExternalKV | None:
        with self._lock:
            num_tokens = self._num_tokens.pop(request_id, None)
        if num_tokens is None:
            return None
        owner = swap_owner_id(request_id)
        keys = self._keys(request_id, -(-num_tokens // self.io.spec.block_size))
        payloads: list = []
        try:
            payloads = self.io.fetch_now(self.ring, keys, owner)
        except (grpc.RpcError, OSError, KVLoadError) as err:  # a lost swap is recomputed, never served wrong
            log.warning("swap-in from the pool failed (%s); recomputing", err, extra={"request_id": request_id})
        finally:
            self._release(owner)  # deferred by PoolIO until mapped views are copied
        if len(payloads) < len(keys):
            if payloads:
                log.warning("swap-in got %d of %d blocks; recomputing", len(payloads), len(keys),
                            extra={"request_id": request_id})
            return None
        return ExternalKV(num_tokens, payloads)

    def discard(self, request_id: str) -> None:
        with self._lock:
            known = self._num_tokens.pop(request_id, None) is not None
        if known:
            self._release(swap_owner_id(request_id))

    def _release(self, owner: str) -> None:
        try:
            self.io.release_now(self.ring, owner)
        except grpc.RpcError as err:  # the lease deadline frees them
            log.warning("swap release failed (%s)", err, extra={"request_id": owner})
