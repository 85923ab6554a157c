"""KVCacheManager: per-request block tables over a BlockPool with prefix caching (vLLM v1).

A request's full blocks are hashed as a chain (core.block_hash) once their KV is computed and
indexed in the pool; a later request whose prompt starts with the same blocks reuses them by
reference count instead of recomputing. A shared block that would be written is copied first
(copy-on-write).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.block_hash import ROOT_PARENT_HASH, hash_block
from core.request import Request
from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BlockTable


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that hold a prefix of a request: ``num_tokens`` = len(block_ids) * block_size."""

    block_ids: list[int]
    num_tokens: int


class KVCacheManager:
    """Grows a request's BlockTable on demand and frees it the moment the request ends."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks, enable_prefix_caching)
        self.block_tables: dict[str, BlockTable] = {}
        self._block_hashes: dict[str, list[int]] = {}  # request id -> hashes of its cached blocks
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    def find_prefix(self, request: Request) -> PrefixHit:
        """Longest run of the request's leading full blocks present in the cache. Reads only
        (besides the hit-rate counters)."""
        bs, tokens = self.block_size, request.all_token_ids
        blocks, parent = [], ROOT_PARENT_HASH
        if self.block_pool.enable_caching:
            for start in range(0, len(tokens) - bs + 1, bs):
                parent = hash_block(parent, tokens[start : start + bs])
                block = self.block_pool.lookup(parent)
                if block is None:
                    break
                blocks.append(block)
        self.num_prefix_queries_tokens += request.num_prompt_tokens
        self.num_prefix_hit_tokens += min(len(blocks) * bs, request.num_prompt_tokens)
        return PrefixHit(blocks, len(blocks) * bs)

    def admit(self, request_id: str, hit: PrefixHit, num_total_tokens: int, cow_last: bool) -> tuple[BlockTable, list[tuple[int, int]]] | None:
        """Starts a request's table with the ``hit`` blocks (shared) and room for ``num_total_tokens``.

        ``cow_last``: the last hit block will be written (its last token is recomputed): copy it
        into a private block. Returns the table and the (src, dst) block copies to run before the
        forward pass, or None (changing nothing) when too few blocks are free.
        Mutates the block pool and ``block_tables``.
        """
        pool = self.block_pool
        shared = hit.block_ids[:-1] if cow_last else hit.block_ids
        num_new = -(-num_total_tokens // self.block_size) - len(shared)
        if num_new + pool.num_evictable(hit.block_ids) > pool.num_free_blocks:
            return None
        pool.touch(hit.block_ids)
        new_blocks = pool.allocate(num_new)
        copies = []
        if cow_last:
            copies.append((hit.block_ids[-1], new_blocks[0]))
            pool.free([hit.block_ids[-1]])
        table = BlockTable(self.block_size, shared + new_blocks)
        self.block_tables[request_id] = table
        self._block_hashes[request_id] = []
        return table, copies

    def allocate_slots(self, request_id: str, num_total_tokens: int) -> BlockTable | None:
        """Makes the request's table hold ``num_total_tokens`` tokens.

        Returns the table, or None (changing nothing) when too few blocks are free.
        Mutates the block pool and ``block_tables``.
        """
        table = self.block_tables.get(request_id) or BlockTable(self.block_size)
        need = table.num_blocks_needed(num_total_tokens)
        if need > self.block_pool.num_free_blocks:
            return None
        table.block_ids.extend(self.block_pool.allocate(need))
        self.block_tables[request_id] = table
        self._block_hashes.setdefault(request_id, [])
        return table

    def cache_full_blocks(self, request: Request) -> None:
        """Indexes every block of ``request`` whose tokens' KV is now computed. Mutates the pool's
        cache index and this request's hash chain."""
        hashes = self._block_hashes.get(request.request_id)
        if hashes is None or not self.block_pool.enable_caching:
            return
        bs, table = self.block_size, self.block_tables[request.request_id]
        num_full = request.num_computed_tokens // bs
        if len(hashes) >= num_full:
            return
        tokens = request.all_token_ids
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        for i in range(len(hashes), num_full):
            parent = hash_block(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
            self.block_pool.cache_block(table.block_ids[i], parent)

    def get(self, request_id: str) -> BlockTable:
        return self.block_tables[request_id]

    def free(self, request_id: str) -> int:
        """Drops the request's references to its blocks; returns how many. Idempotent."""
        self._block_hashes.pop(request_id, None)
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return 0
        self.block_pool.free(table.block_ids)
        return len(table.block_ids)
