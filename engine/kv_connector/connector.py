"""KVConnector: a worker's one road to the KV pool (docs/design.md §3 "KV connector to the pool").

It owns where the pool is (:class:`PoolLocator`: the ring of pool nodes), how bytes move
(:class:`PoolIO`: a transfer backend per node, checksums written and verified), the pool -> worker
bandwidth meter the router's cost model reads, and the release of every request it touched.
Operations: load a cached prefix, load a manifest, save a prompt's blocks, swap out / swap in
(:meth:`swap_space`), release; and for a decode worker, :meth:`load_for_decode`: which of the
three ways a request arrives (engine.kv_connector.decode_start) and what its KV start is.

Who releases a request's pool state (leases and request-scoped blocks; docs/design.md §5)
-------------------------------------------------------------------------------------
Exactly one connector holds a request at any time, and only the holder releases it, once:

::

    prefill worker's connector        router            decode worker's connector
    lease prefix, write blocks ──► answer (manifest) ──► load_manifest: fetch, release
      failure / cancel: release      hand_off: holds    early finish / refused: drop_manifest
      ends at its first token:       nothing any more   resumed (migration): lease, load, release
      release (no Decode follows)

- *finish*: the decode connector releases right after fetching (the blocks stay readable to
  others, only the request's leases and its scoped tail go); the request then lives in the
  decode worker's paged cache and frees its blocks there on finish.
- *abort*: before the prefill answers, the prefill connector releases (the RPC is cancelled);
  once a Decode RPC with the manifest arrived, the decode connector does, whatever happens next.
- *undelivered*: a manifest no Decode took over (the client left before the router sent it, or
  the stream was cancelled before the worker ran it: a hung worker that wakes up finds the call
  already cancelled and never sees the request) — the router sends ``DropManifest`` to the
  decode worker it was meant for, whose connector releases it unless a Decode of that id came
  first (:meth:`drop_undelivered`; the first of the two to arrive settles it, the other is a
  no-op).
- *failure*: a worker that fails an RPC releases what it holds before answering; a worker that
  dies holds nothing past the lease deadline, which the pool enforces by itself (docs/design.md §5)
  — as it does for a dropped manifest whose decode worker is gone.
- *migration*: the resumed attempt has its own request id; its connector leases the stored
  prefix, loads it and releases it.

The router never releases: it cannot know which ArenaBlock views a decode worker has not copied
yet (:mod:`engine.kv_connector.pool_io` defers a release until they are), and a second releaser
is how blocks were released twice.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import Sequence

import grpc

from core.block_hash import hash_block_chain
from core.block_key import BlockKey
from core.cost_model import BandwidthMeter
from core.kv_cache_spec import KVCacheSpec
from core.pool_ring import HashRing
from core.request import Request
from engine.kv_connector.decode_start import DecodeStart, append_outputs
from engine.kv_connector.load_failure import MISSING, UNREACHABLE, KVLoadError, KVLoadFailures
from engine.kv_connector.locator import PoolLocator
from engine.kv_connector.manifest import Manifest
from engine.kv_connector.pool_io import PoolIO
from engine.kv_connector.swap import PoolSwapSpace
from engine.outputs import ExternalKV

log = logging.getLogger(__name__)

# Manifests a decode connector remembers settling (taken over by a Decode, or dropped): a
# DropManifest or a Decode arrives at most a request timeout after the other.
MAX_SETTLED_MANIFESTS = 4096
# A release the pool did not get (a partition, a pool restarting) is sent again after each of
# these delays, then every last one, until the lease deadline would have freed it anyway.
RELEASE_RETRY_DELAYS_S = (1.0, 2.0, 4.0)
RETRIED_RELEASE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class KVConnector:
    """One per worker; used from the worker's event loop (``swap_space`` from the engine thread).

    ``io``: the transport (default: a :class:`PoolIO` over ``locator.kv_transfer``);
    ``failures``: what a failed load does (default: recompute, counted in this process's registry);
    ``release_retry_delays_s``: the backoff of a release the pool did not get (:meth:`release`).
    """

    def __init__(self, spec: KVCacheSpec, locator: PoolLocator, io: PoolIO | None = None,
                 failures: KVLoadFailures | None = None,
                 release_retry_delays_s: Sequence[float] = RELEASE_RETRY_DELAYS_S):
        self.spec = spec
        self.locator = locator
        self.io = io or PoolIO(spec, transfer=locator.kv_transfer)
        self.failures = failures or KVLoadFailures()
        # Pool -> worker KV bandwidth (the router's KV-load estimate: bytes / this).
        self.kv_load = BandwidthMeter()
        # request_id -> the pool nodes where this connector holds the request's leases / blocks.
        self._holding: dict[str, HashRing] = {}
        self.num_releases = 0  # requests this connector released (each exactly once)
        # request_id -> True when a Decode took its manifest over, False when DropManifest dropped it.
        self._settled: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self.release_retry_delays_s = tuple(release_retry_delays_s)
        self._release_retries: set[asyncio.Task] = set()  # releases the pool did not get, sent again

    async def ring(self) -> HashRing:
        """The pool nodes. Raises LookupError when no pool is registered."""
        return await self.locator.ring()

    def prompt_keys(self, request_id: str, prompt_token_ids: list[int]) -> list[BlockKey]:
        """One key per prompt block: full blocks content-addressed, the tail request-scoped."""
        return self.io.prompt_keys(request_id, prompt_token_ids)[1]

    async def load_cached_prefix(self, request_id: str, token_ids: list[int], ring: HashRing) -> ExternalKV | None:
        """Leases the longest stored prefix of ``token_ids``' full blocks for the request (held
        until :meth:`release` or :meth:`hand_off`) and returns its verified KV; None when the
        pool has none, or when the load failed and the policy is to recompute.

        Raises:
            KVLoadError: the load failed and the policy is ``fail``.
        """
        return await self._load_prefix("prefix", request_id, token_ids, ring)

    async def _load_prefix(self, stage: str, request_id: str, token_ids: list[int], ring: HashRing) -> ExternalKV | None:
        hashes = hash_block_chain(token_ids, self.spec.block_size)
        if not hashes:
            return None
        self._holding[request_id] = ring
        started_s = time.perf_counter()
        try:
            payloads = await self.io.load_cached_prefix(ring, request_id, hashes)
        except KVLoadError as err:
            self.failures.failed(stage, err, request_id)
            return None  # recompute every token
        self._record(len(payloads), started_s)
        return ExternalKV(len(payloads) * self.spec.block_size, payloads) if payloads else None

    async def load_resumed(self, request_id: str, token_ids: list[int]) -> ExternalKV | None:
        """KV of the longest stored prefix of ``token_ids`` (a resumed request's prompt + outputs;
        in practice the prompt's full blocks), then the request is released. None when the pool
        has none (or cannot be reached, or the load failed under ``recompute``): the engine
        recomputes everything after what it gets. Raises KVLoadError under ``fail``."""
        try:
            ring = await self.locator.ring()
        except LookupError as err:
            self.failures.failed("resume", KVLoadError(UNREACHABLE, str(err)), request_id)
            return None
        try:
            return await self._load_prefix("resume", request_id, token_ids, ring)
        finally:
            await self.release(request_id)

    async def load_manifest(self, request_id: str, manifest: Manifest) -> ExternalKV | None:
        """Takes the request over from the prefill worker, fetches the manifest's blocks, releases
        the request in the pool. A load that fails (the pool died, a transfer failed, a block
        fails its checksum, the lease was lost) follows the policy: under ``recompute`` it
        returns None (the engine prefills the prompt); blocks that are merely gone leave the
        verified full blocks before them (None when there are none).

        Raises:
            KVLoadError: the load failed (or blocks were gone) and the policy is ``fail``; the
                request is released in the pool first.
        """
        payloads: list = []
        try:
            ring = await self._manifest_ring(request_id, manifest)
        except LookupError as err:
            self.failures.failed("manifest", KVLoadError(UNREACHABLE, str(err)), request_id)
            return None
        failure: KVLoadError | None = None
        try:
            started_s = time.perf_counter()
            payloads = await self.io.fetch(ring, manifest.keys, request_id)
            self._record(len(payloads), started_s)
        except KVLoadError as err:
            failure = err
        finally:
            await self.release(request_id)
        if failure is not None:
            self.failures.failed("manifest", failure, request_id)
            return None
        if len(payloads) == len(manifest.keys):
            return ExternalKV(manifest.num_tokens, payloads)
        missing = KVLoadError(MISSING, f"the pool gave {len(payloads)} of the manifest's {len(manifest.keys)} blocks")
        self.failures.failed("manifest", missing, request_id)
        # Recompute the rest only: the blocks before the gap are verified full blocks.
        return ExternalKV(len(payloads) * self.spec.block_size, payloads) if payloads else None

    async def load_for_decode(self, request: Request, start: DecodeStart) -> ExternalKV | None:
        """Takes a Decode RPC's request over and returns the KV the engine starts it from:

        - disaggregated: appends the first token; when that ends the request, releases the
          manifest's pool state (None); else :meth:`load_manifest`;
        - resumed: appends the output tokens so far; unless that ends the request,
          :meth:`load_resumed` (the longest stored prefix of prompt + outputs);
        - colocated: None (the engine prefills).

        ``request.is_finished`` afterwards: it ended before any step (answer Finished at once).
        Mutates ``request`` (its output tokens).

        Raises:
            ValueError: the pieces do not fit together, the manifest is of another KV spec or
                was dropped already (:meth:`drop_undelivered`), or the outputs run past the
                request's end; nothing was taken over (:meth:`refuse`).
            KVLoadError: the load failed and the policy is ``fail``; the request is released.
        """
        start.validate(self.spec, request.num_prompt_tokens)
        rid = request.request_id
        if start.manifest is not None:
            if not self._settle(rid, taken=True):
                raise ValueError(f"the manifest of {rid} was dropped before this Decode arrived")
            if request.append_output_token(start.first_token_id) is not None:
                await self.drop_manifest(rid, start.manifest)
                return None
            return await self.load_manifest(rid, start.manifest)
        if not start.output_token_ids:
            return None
        append_outputs(request, start.output_token_ids)
        if request.is_finished:
            return None
        external = await self.load_resumed(rid, request.all_token_ids)
        log.info("resuming after %d output tokens: %d of %d tokens loaded from the pool, the rest recomputed",
                 request.num_output_tokens, external.num_tokens if external else 0, request.num_tokens,
                 extra={"request_id": rid})
        return external

    async def refuse(self, request_id: str, start: DecodeStart) -> None:
        """Releases what a refused Decode RPC handed over (a manifest's pool state: this worker
        got it, no one else will release it early)."""
        if start.manifest is None:
            return
        # Not when DropManifest came first: it released the manifest already.
        if self._settle(request_id, taken=True) or self._settled.get(request_id):
            await self.drop_manifest(request_id, start.manifest)

    async def drop_undelivered(self, request_id: str, manifest: Manifest) -> bool:
        """Releases a manifest the router gave up delivering, unless a Decode of ``request_id``
        took it over here first (then that Decode releases it). Afterwards a Decode of that id is
        refused. Returns True when this call released it. Mutates the settled record."""
        if not self._settle(request_id, taken=False):
            return False
        log.info("manifest dropped by the router before any Decode took it over: released",
                 extra={"request_id": request_id})
        await self.drop_manifest(request_id, manifest)
        return True

    def _settle(self, request_id: str, taken: bool) -> bool:
        """Records who settled ``request_id``'s manifest (a Decode took it over, or it was dropped);
        False when it was settled before. Keeps the last MAX_SETTLED_MANIFESTS."""
        if request_id in self._settled:
            return False
        self._settled[request_id] = taken
        if len(self._settled) > MAX_SETTLED_MANIFESTS:
            self._settled.popitem(last=False)
        return True

    async def drop_manifest(self, request_id: str, manifest: Manifest) -> None:
        """Takes the request over and releases it without loading (it ended with its first token,
        or this worker refused it)."""
        try:
            await self._manifest_ring(request_id, manifest)
        except LookupError:
            return
        await self.release(request_id)

    async def save(
        self, request_id: str, ring: HashRing, keys: list[BlockKey], payloads: Sequence[bytes], skip: int
    ) -> None:
        """Writes blocks ``skip..`` (those not loaded from the pool) with checksums, leased to the
        request (held until :meth:`release` or :meth:`hand_off`)."""
        self._holding[request_id] = ring
        await self.io.store(ring, request_id, keys, list(payloads), skip)

    def manifest(self, ring: HashRing, keys: list[BlockKey], num_tokens: int) -> Manifest:
        """The manifest of blocks saved to ``ring``. One node: its address; several: "" (the
        decode worker places the keys on its own ring)."""
        address = ring.addresses[0] if len(ring.nodes) == 1 else ""
        return Manifest(self.spec.fingerprint, address, keys, num_tokens, self.spec.kv_dtype_name)

    def hand_off(self, request_id: str) -> None:
        """The request's pool state now belongs to whoever receives its manifest: forget it
        without releasing. Mutates only this connector."""
        self._holding.pop(request_id, None)

    async def release(self, request_id: str) -> None:
        """Ends the request on every pool node it holds: drops its leases and scoped blocks.
        At most once per hold (a second call is a no-op). Deferred while ArenaBlock views are
        uncopied (PoolIO). A pool that does not answer (UNAVAILABLE, DEADLINE_EXCEEDED: a
        partition, a restart) is sent the release again in the background after each of
        ``release_retry_delays_s``, until its lease deadline would have freed the request anyway:
        a partition that heals frees the blocks then, not a lease TTL later."""
        ring = self._holding.pop(request_id, None)
        if ring is None:
            return
        self.num_releases += 1
        try:
            await self.io.release(ring, request_id)
        except grpc.RpcError as err:
            if err.code() not in RETRIED_RELEASE_CODES or not self.release_retry_delays_s:
                log.warning("KV pool release failed (%s)", err.code(), extra={"request_id": request_id})
                return
            log.warning("KV pool release failed (%s); sending it again until the lease deadline", err.code(),
                        extra={"request_id": request_id})
            task = asyncio.create_task(self._release_again(ring, request_id))
            self._release_retries.add(task)
            task.add_done_callback(self._release_retries.discard)

    async def _release_again(self, ring: HashRing, request_id: str) -> None:
        """Sends a failed release again until the pool takes it or the lease deadline passes."""
        deadline_s = time.monotonic() + self.io.lease_ttl_s
        for attempt in itertools.count():
            delay_s = self.release_retry_delays_s[min(attempt, len(self.release_retry_delays_s) - 1)]
            if time.monotonic() + delay_s > deadline_s:
                log.info("KV pool release not taken before the lease deadline (it frees the request)",
                         extra={"request_id": request_id})
                return
            await asyncio.sleep(delay_s)  # a backoff between attempts, not a synchronisation
            try:
                await self.io.release(ring, request_id)
            except grpc.RpcError as err:
                if err.code() not in RETRIED_RELEASE_CODES:
                    log.warning("KV pool release failed (%s)", err.code(), extra={"request_id": request_id})
                    return
                continue
            log.info("KV pool release taken on attempt %d", attempt + 2, extra={"request_id": request_id})
            return

    def swap_space(self, lease_ttl_s: float = 600.0) -> PoolSwapSpace | None:
        """Swap preemption into the pool, over the fixed ring of pool nodes and checksummed;
        None when the pool is found through the registry (the engine swaps into host memory)."""
        ring = self.locator.fixed_ring
        return PoolSwapSpace(self.io, ring, lease_ttl_s) if ring is not None else None

    def close(self) -> None:
        for task in list(self._release_retries):  # the pool's lease deadline frees what they held
            task.cancel()
        self.io.close()

    async def _manifest_ring(self, request_id: str, manifest: Manifest) -> HashRing:
        """Where the manifest's blocks are, now held by this connector. Raises LookupError."""
        address = manifest.pool_address
        ring = HashRing({address: address}) if address else await self.locator.ring()
        self._holding[request_id] = ring
        return ring

    def _record(self, num_blocks: int, started_s: float) -> None:
        if num_blocks:
            self.kv_load.record(num_blocks * self.spec.block_bytes, time.perf_counter() - started_s)
