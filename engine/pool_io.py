"""Moves a request's KV blocks between a worker and the KV pool (the KV connector's transport side).

Blocks are spread over pool nodes by consistent hashing (:class:`core.pool_ring.HashRing`); a
node that fails only loses its share, which readers then recompute. How the bytes move is a
:mod:`core.kv_transfer` backend chosen per pool node (``--kv-transfer``);
this module adds what every backend shares: checksums computed on write and verified on read
(DESIGN.md §4), with a corrupt block reported to the pool (which drops it) and the read cut
before it, so the caller recomputes that part instead of using wrong KV. Blocking backend calls
run in worker threads so the event loop and the engine's step loop never wait on the network.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

import grpc

from core.block_hash import hash_block_chain
from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.kv_transfer.checksum import block_checksum, matches, verify_enabled
from core.kv_transfer.select import connect
from core.pool_client import PoolClient
from core.pool_ring import HashRing

# Where blocks go: one pool address, or a ring of pool nodes (consistent hashing of block keys).
PoolTarget = str | HashRing

log = logging.getLogger(__name__)


class PoolIO:
    """One client and one transfer backend per pool address, shared by all requests of a worker.

    ``transfer``: auto, grpc, shm or nixl (see ``core.kv_transfer.select``); ``verify_checksums``
    defaults to the environment (``TANDEM_KV_VERIFY_CHECKSUMS``, on unless "0").
    """

    def __init__(
        self, spec: KVCacheSpec, lease_ttl_s: float = 60.0, transfer: str = "auto",
        verify_checksums: bool | None = None,
    ):
        self.spec = spec
        self.lease_ttl_s = lease_ttl_s
        self.transfer = transfer
        self.verify_checksums = verify_enabled() if verify_checksums is None else verify_checksums
        self.num_corrupt_blocks = 0  # blocks this worker found corrupt and reported
        self._clients: dict[str, PoolClient] = {}
        self._backends: dict[str, TransferBackend] = {}
        self._lock = threading.Lock()

    def client(self, address: str) -> PoolClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = PoolClient(address)
            return self._clients[address]

    def backend(self, address: str) -> TransferBackend:
        """The transfer backend for ``address``, chosen on first use (blocking: GetDataPlane)."""
        with self._lock:
            backend = self._backends.get(address)
        if backend is None:
            backend = connect(self.transfer, self.client(address))
            log.info("kv transfer to pool %s: %s", address, backend.name)
            with self._lock:
                backend = self._backends.setdefault(address, backend)
        return backend

    def prompt_keys(self, request_id: str, prompt_token_ids: list[int]) -> tuple[list[int], list[BlockKey]]:
        """Hash chain of the prompt's full blocks, and one key per prompt block (tail scoped)."""
        fp, bs = self.spec.fingerprint, self.spec.block_size
        hashes = hash_block_chain(prompt_token_ids, bs)
        keys = [BlockKey.content(fp, h) for h in hashes]
        if len(prompt_token_ids) % bs:
            keys.append(BlockKey.scoped(fp, request_id, len(hashes)))
        return hashes, keys

    async def load_cached_prefix(self, pool: PoolTarget, request_id: str, hashes: list[int]) -> list[bytes]:
        """Leases the longest stored prefix of ``hashes`` for the request and fetches its verified
        part (a corrupt block and everything after it are left to recompute)."""
        if not hashes:
            return []
        keys = [BlockKey.content(self.spec.fingerprint, h) for h in hashes]
        return await self.fetch(pool, keys, request_id)

    async def store(self, pool: PoolTarget, request_id: str, keys: list[BlockKey], payloads: list[bytes], skip: int) -> None:
        """Writes blocks ``skip..`` (those not loaded from the pool), with checksums, leased to
        the request, each to its node. A node that fails loses only its share (logged): readers
        recompute what they do not find."""
        keys, payloads = keys[skip:], payloads[skip:]
        if not keys:
            return
        await asyncio.to_thread(self._store, _ring(pool), request_id, keys, payloads)

    async def fetch(self, pool: PoolTarget, keys: list[BlockKey], request_id: str) -> list[bytes]:
        """Leases the longest stored prefix of ``keys`` to the request and returns its verified
        part, in order: fewer than ``keys`` when a block is missing, corrupt, or on a node that
        does not answer."""
        return await asyncio.to_thread(self._fetch, _ring(pool), keys, request_id)

    async def release(self, pool: PoolTarget, request_id: str) -> None:
        """Ends the request on every pool node: drops its leases and scoped blocks. Idempotent;
        a node that does not answer holds nothing that outlives its lease deadline."""
        await asyncio.to_thread(self._release, _ring(pool), request_id)

    def _store(self, ring: HashRing, request_id: str, keys: list[BlockKey], payloads: list[bytes]) -> None:
        checksums = [block_checksum(p) for p in payloads]
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_node.setdefault(ring.address_for(key), []).append(i)
        for address, idx in by_node.items():
            try:
                self.backend(address).write(
                    [keys[i] for i in idx], [payloads[i] for i in idx], [checksums[i] for i in idx],
                    request_id, self.lease_ttl_s,
                )
            except (grpc.RpcError, OSError) as err:
                if len(ring.nodes) == 1:
                    raise
                self._forget(address)
                log.warning("pool %s did not take %d blocks (%s); readers will recompute them",
                            address, len(idx), _why(err), extra={"request_id": request_id})

    def _fetch(self, ring: HashRing, keys: list[BlockKey], request_id: str) -> list[bytes]:
        """Reads runs of consecutive keys that live on one node, in order, until one comes short."""
        out: list[bytes] = []
        start = 0
        while start < len(keys):
            address = ring.address_for(keys[start])
            end = start + 1
            while end < len(keys) and ring.address_for(keys[end]) == address:
                end += 1
            run = self._read_run(address, keys[start:end], request_id, single_node=len(ring.nodes) == 1)
            out += run
            if len(run) < end - start:
                break
            start = end
        return out

    def _read_run(self, address: str, keys: list[BlockKey], request_id: str, single_node: bool) -> list[bytes]:
        try:
            blocks = self.backend(address).read(keys, request_id, self.lease_ttl_s)
        except (grpc.RpcError, OSError) as err:
            if single_node:
                raise
            self._forget(address)
            log.warning("pool %s did not answer (%s); recomputing from there", address, _why(err),
                        extra={"request_id": request_id})
            return []
        num_good = self._num_verified(blocks)
        if num_good < len(blocks):
            bad = keys[num_good]
            self.num_corrupt_blocks += 1
            log.warning("block %s from pool %s failed its checksum: dropped there, recomputing from it",
                        bad, address, extra={"request_id": request_id})
            self.client(address).report_corrupt([bad])
        return [b.data for b in blocks[:num_good]]

    def _release(self, ring: HashRing, request_id: str) -> None:
        for address in ring.addresses:
            try:
                self.client(address).release_request(request_id)
            except grpc.RpcError as err:
                if len(ring.nodes) == 1:
                    raise
                log.warning("pool %s did not take the release (%s)", address, _why(err),
                            extra={"request_id": request_id})

    def _forget(self, address: str) -> None:
        """Drops the backend of a node that failed: the next use picks one afresh."""
        with self._lock:
            backend = self._backends.pop(address, None)
        if backend is not None:
            backend.close()

    def _num_verified(self, blocks: Sequence[ReadBlock]) -> int:
        if not self.verify_checksums:
            return len(blocks)
        for i, block in enumerate(blocks):
            if not matches(block.data, block.checksum):
                return i
        return len(blocks)


def _ring(pool: PoolTarget) -> HashRing:
    """A ring of one node for a bare address (one pool, or a manifest's pool_address)."""
    return pool if isinstance(pool, HashRing) else HashRing({pool: pool})


def _why(err: Exception) -> str:
    return err.details() if isinstance(err, grpc.RpcError) and hasattr(err, "details") else str(err)
