"""Moves a request's KV blocks between a worker and the KV pool (the KV connector's transport side).

Blocks are spread over pool nodes by consistent hashing (:class:`core.pool_ring.HashRing`); a
node that fails only loses its share, which readers then recompute. How the bytes move is a
:mod:`core.kv_transfer` backend chosen per pool node (``--kv-transfer``);
this module adds what every backend shares: checksums computed on write and verified on read
(docs/design.md §4), with a corrupt block reported to the pool (which drops it) and the read cut
before it, so the caller recomputes that part instead of using wrong KV. Blocking backend calls
run in worker threads so the event loop and the engine's step loop never wait on the network.

On the shared-memory backend reads are zero-copy (``map_arena``): ``fetch`` verifies each block
in the mapped arena and returns :class:`~engine.kv_connector.blocks.ArenaBlock` views, which the model
runner copies straight into its KV cache. The pool must not reuse those slots before that copy,
so a ``release`` of the request while its views are not yet copied is deferred until they are
(or until they are dropped unused); the pool's lease deadline bounds it either way::

    fetch: lease ──► verify in place ──► ArenaBlock views ──► (step loop) copy into KV cache
    release(request) ─────────── deferred while a view is uncopied ───────────┘──► ReleaseRequest
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from core.block_hash import hash_block_chain
from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.kv_transfer.backend import ReadBlock, TransferBackend
from core.kv_transfer.checksum import block_checksum, matches, verify_enabled
from core.kv_transfer.metered import metered
from core.kv_transfer.select import connect
from core.pool_client import IncompleteReadError, PoolClient
from core.pool_ring import HashRing
from engine.kv_connector.blocks import ArenaBlock, LoadGuard
from engine.kv_connector.lease_keeper import LeaseKeeper, LeaseLostError, LeaseWatch
from engine.kv_connector.load_failure import CHECKSUM, LEASE_LOST, TRUNCATED, KVLoadError, reason_of

# Where blocks go: one pool address, or a ring of pool nodes (consistent hashing of block keys).
PoolTarget = str | HashRing

log = logging.getLogger(__name__)


@dataclass
class _PendingLoad:
    """A request whose ArenaBlock views are not all copied yet."""

    num_guards: int  # fetches whose views are still uncopied
    release_ring: HashRing | None = None  # set when a release of the request was deferred
    watches: list[LeaseWatch] = field(default_factory=list)  # leases renewed until the views are copied


class PoolIO:
    """One client and one transfer backend per pool address, shared by all requests of a worker.

    ``transfer``: auto, grpc, shm or nixl (see ``core.kv_transfer.select``); ``verify_checksums``
    defaults to the environment (``TANDEM_KV_VERIFY_CHECKSUMS``, on unless "0"); ``map_arena``:
    shm reads return ArenaBlock views of the pool's arena instead of copies (see above).
    """

    def __init__(
        self, spec: KVCacheSpec, lease_ttl_s: float = 60.0, transfer: str = "auto",
        verify_checksums: bool | None = None, map_arena: bool = True,
    ):
        self.spec = spec
        self.lease_ttl_s = lease_ttl_s
        self.transfer = transfer
        self.verify_checksums = verify_enabled() if verify_checksums is None else verify_checksums
        self.num_corrupt_blocks = 0  # blocks this worker found corrupt and reported
        self._clients: dict[str, PoolClient] = {}
        self._backends: dict[str, TransferBackend] = {}
        # Reentrant: a LoadGuard's finalizer (garbage collection) may run while this thread holds it.
        self._lock = threading.RLock()
        self.map_arena = map_arena
        self._pending_loads: dict[str, _PendingLoad] = {}  # request_id -> uncopied views
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="pool-release")  # deferred releases
        self.leases = LeaseKeeper(lease_ttl_s)  # renews leases of long reads, proves they held

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
            backend = metered(connect(self.transfer, self.client(address)))  # bytes/seconds/errors counted
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

    async def load_cached_prefix(
        self, pool: PoolTarget, request_id: str, hashes: list[int]
    ) -> list[bytes | ArenaBlock]:
        """Leases the longest stored prefix of ``hashes`` for the request and fetches its verified
        part (a corrupt block and everything after it are left to recompute)."""
        if not hashes:
            return []
        keys = [BlockKey.content(self.spec.fingerprint, h) for h in hashes]
        return await self.fetch(pool, keys, request_id)

    async def store(
        self, pool: PoolTarget, request_id: str, keys: list[BlockKey], payloads: list[bytes], skip: int
    ) -> None:
        """Writes blocks ``skip..`` (those not loaded from the pool), with checksums, leased to
        the request, each to its node. A node that fails loses only its share (logged): readers
        recompute what they do not find."""
        keys, payloads = keys[skip:], payloads[skip:]
        if not keys:
            return
        await asyncio.to_thread(self.store_now, _ring(pool), request_id, keys, payloads)

    async def fetch(self, pool: PoolTarget, keys: list[BlockKey], request_id: str) -> list[bytes | ArenaBlock]:
        """Leases the longest stored prefix of ``keys`` to the request and returns it, verified,
        in order (fewer than ``keys`` when the pool holds fewer). Blocks read through shared
        memory are ArenaBlock views (``map_arena``), to be handed to
        ``engine.kv_connector.unpack_blocks`` (or dropped).

        Raises:
            KVLoadError: a node did not answer or failed, a block came incomplete or failed its
                checksum (reported to the pool, which drops it), or the read's lease was lost.
        """
        return await asyncio.to_thread(self.fetch_now, _ring(pool), keys, request_id)

    async def release(self, pool: PoolTarget, request_id: str) -> None:
        """Ends the request on every pool node: drops its leases and scoped blocks. Idempotent;
        a node that does not answer holds nothing that outlives its lease deadline. Deferred
        (returns at once) while ArenaBlock views fetched for the request are not yet copied."""
        if not self._defer_release(_ring(pool), request_id):
            await asyncio.to_thread(self._release, _ring(pool), request_id)

    def release_now(self, ring: HashRing, request_id: str) -> None:
        """:meth:`release`, blocking (from the engine thread: swap space)."""
        if not self._defer_release(ring, request_id):
            self._release(ring, request_id)

    def _defer_release(self, ring: HashRing, request_id: str) -> bool:
        """True when views of ``request_id`` are uncopied: the release runs once they are."""
        with self._lock:
            pending = self._pending_loads.get(request_id)
            if pending is not None:
                pending.release_ring = ring
                return True
        return False

    def close(self) -> None:
        """Closes every backend and client; deferred releases still queued run first."""
        self._releaser.shutdown(wait=True)
        self.leases.close()
        with self._lock:
            backends, clients = list(self._backends.values()), list(self._clients.values())
            self._backends, self._clients = {}, {}
        for backend in backends:
            backend.close()
        for client in clients:
            client.close()

    def store_now(
        self, ring: HashRing, request_id: str, keys: list[BlockKey], payloads: list[bytes],
        lease_ttl_s: float | None = None,
    ) -> None:
        """:meth:`store` of every block, blocking. ``lease_ttl_s``: default the connector's."""
        ttl_s = self.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        checksums = [block_checksum(p) for p in payloads]
        by_node: dict[str, list[int]] = {}
        for i, key in enumerate(keys):
            by_node.setdefault(ring.address_for(key), []).append(i)
        for address, idx in by_node.items():
            try:
                self.backend(address).write(
                    [keys[i] for i in idx], [payloads[i] for i in idx], [checksums[i] for i in idx],
                    request_id, ttl_s,
                )
            except (grpc.RpcError, OSError) as err:
                if len(ring.nodes) == 1:
                    raise
                self._forget(address)
                log.warning("pool %s did not take %d blocks (%s); readers will recompute them",
                            address, len(idx), _why(err), extra={"request_id": request_id})

    def fetch_now(self, ring: HashRing, keys: list[BlockKey], request_id: str) -> list[bytes | ArenaBlock]:
        """:meth:`fetch`, blocking. Reads runs of consecutive keys that live on one node, in order,
        until one comes short. Raises KVLoadError as :meth:`fetch`."""
        out: list[bytes | ArenaBlock] = []
        guard = self._guard(request_id) if self.map_arena else None
        try:
            start = 0
            while start < len(keys):
                address = ring.address_for(keys[start])
                end = start + 1
                while end < len(keys) and ring.address_for(keys[end]) == address:
                    end += 1
                run = self._read_run(address, keys[start:end], request_id, guard)
                out += run
                if len(run) < end - start:
                    break
                start = end
        except BaseException:
            out = []  # no byte of a failed read is used
            raise
        finally:
            if guard is not None and not any(isinstance(b, ArenaBlock) for b in out):
                guard.done()  # nothing mapped (or the read failed): no release to defer
        return out

    def _guard(self, request_id: str) -> LoadGuard:
        """A LoadGuard of ``request_id``'s views; the request's releases wait for it."""
        with self._lock:
            pending = self._pending_loads.setdefault(request_id, _PendingLoad(0))
            pending.num_guards += 1
        return LoadGuard(lambda: self._load_done(request_id))

    def _load_done(self, request_id: str) -> None:
        """A guard of ``request_id`` is done (copied or dropped): run a deferred release once
        the last one is. Called from any thread, the step loop's included: never blocks."""
        with self._lock:
            pending = self._pending_loads.get(request_id)
            if pending is None:
                return
            pending.num_guards -= 1
            if pending.num_guards > 0:
                return
            del self._pending_loads[request_id]
        for watch in pending.watches:  # copied: no need to keep the leases alive any more
            self.leases.unwatch(watch)
        if pending.release_ring is not None:
            try:
                self._releaser.submit(self._release_quietly, pending.release_ring, request_id)
            except RuntimeError:  # closed: the pool's lease deadline releases it
                pass

    def _release_quietly(self, ring: HashRing, request_id: str) -> None:
        try:
            self._release(ring, request_id)
        except grpc.RpcError as err:  # the lease deadline releases it
            log.warning("deferred pool release failed (%s)", _why(err), extra={"request_id": request_id})

    def _read_run(
        self, address: str, keys: list[BlockKey], request_id: str, guard: LoadGuard | None
    ) -> list[bytes | ArenaBlock]:
        """Reads ``keys`` (all on ``address``) under a watched lease; views stay watched (renewed)
        until copied. Raises KVLoadError."""
        watch = self.leases.watch(request_id, self.client(address))
        kept = False  # renewed on until the views are copied (PoolIO._load_done)
        try:
            blocks = self._read_blocks(address, keys, request_id, guard)
            lease_ids = {b.lease_id for b in blocks}
            if len(lease_ids) > 1:  # a pipelined read's batches under different leases: let go between
                raise LeaseLostError(f"the pool lease of {request_id} changed during the read")
            if blocks:
                views = guard is not None and isinstance(blocks[0].data, ArenaBlock)
                self.leases.finish(watch, lease_ids.pop(), keep=views)
                if views:
                    with self._lock:
                        self._pending_loads[request_id].watches.append(watch)
                    kept = True
        except LeaseLostError as err:
            raise KVLoadError(LEASE_LOST, str(err)) from err
        finally:
            if not kept:
                self.leases.unwatch(watch)
        num_good = self._num_verified(blocks)
        if num_good < len(blocks):
            bad = keys[num_good]
            self.num_corrupt_blocks += 1
            self._report_corrupt(address, bad, request_id)
            raise KVLoadError(CHECKSUM, f"block {bad} from pool {address} failed its checksum (dropped there)")
        return [b.data for b in blocks]

    def _read_blocks(
        self, address: str, keys: list[BlockKey], request_id: str, guard: LoadGuard | None
    ) -> list[ReadBlock]:
        """The backend's read (views when ``guard``). Raises KVLoadError."""
        try:
            backend = self.backend(address)
            blocks = backend.read_views(keys, request_id, self.lease_ttl_s) if guard is not None else None
            if blocks is None:
                return backend.read(keys, request_id, self.lease_ttl_s)
            return [ReadBlock(ArenaBlock.wrap(b.data, guard), b.checksum, b.lease_id) for b in blocks]
        except IncompleteReadError as err:
            raise KVLoadError(TRUNCATED, f"pool {address}: {err}") from err
        except (grpc.RpcError, OSError) as err:
            self._forget(address)
            raise KVLoadError(reason_of(err), f"pool {address}: {_why(err)}") from err

    def _report_corrupt(self, address: str, key: BlockKey, request_id: str) -> None:
        try:
            self.client(address).report_corrupt([key])
        except grpc.RpcError as err:  # the next reader finds it corrupt too
            log.warning("could not report corrupt block %s (%s)", key, _why(err), extra={"request_id": request_id})

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
