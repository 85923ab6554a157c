"""Moves a request's KV blocks between a worker and the KV pool (the KV connector's transport side).

Blocking calls on core.pool_client.PoolClient, run in worker threads so the event loop and the
engine's step loop never wait on the network.
"""

from __future__ import annotations

import asyncio
import threading

from core.block_hash import hash_block_chain
from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec
from core.pool_client import PoolClient


class PoolIO:
    """One PoolClient per pool address, shared by all requests of a worker."""

    def __init__(self, spec: KVCacheSpec, lease_ttl_s: float = 60.0):
        self.spec = spec
        self.lease_ttl_s = lease_ttl_s
        self._clients: dict[str, PoolClient] = {}
        self._lock = threading.Lock()

    def client(self, address: str) -> PoolClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = PoolClient(address)
            return self._clients[address]

    def prompt_keys(self, request_id: str, prompt_token_ids: list[int]) -> tuple[list[int], list[BlockKey]]:
        """Hash chain of the prompt's full blocks, and one key per prompt block (tail scoped)."""
        fp, bs = self.spec.fingerprint, self.spec.block_size
        hashes = hash_block_chain(prompt_token_ids, bs)
        keys = [BlockKey.content(fp, h) for h in hashes]
        if len(prompt_token_ids) % bs:
            keys.append(BlockKey.scoped(fp, request_id, len(hashes)))
        return hashes, keys

    async def load_cached_prefix(self, address: str, request_id: str, hashes: list[int]) -> list[bytes]:
        """Leases the longest stored prefix of ``hashes`` for the request and fetches it."""
        client = self.client(address)
        n = await asyncio.to_thread(client.acquire_lease, self.spec.fingerprint, hashes, request_id, self.lease_ttl_s)
        if n == 0:
            return []
        keys = [BlockKey.content(self.spec.fingerprint, h) for h in hashes[:n]]
        return await asyncio.to_thread(client.get_blocks, keys)

    async def store(self, address: str, request_id: str, keys: list[BlockKey], payloads: list[bytes], skip: int) -> None:
        """Writes blocks ``skip..`` (those not loaded from the pool), leased to the request."""
        items = list(zip(keys[skip:], payloads[skip:]))
        client = self.client(address)
        await asyncio.to_thread(client.put_blocks, items, request_id, self.lease_ttl_s)

    async def fetch(self, address: str, keys: list[BlockKey]) -> list[bytes]:
        return await asyncio.to_thread(self.client(address).get_blocks, keys)

    async def release(self, address: str, request_id: str) -> None:
        """Ends the request in the pool: drops its leases and scoped blocks. Idempotent."""
        await asyncio.to_thread(self.client(address).release_request, request_id)
