"""KVCacheManager: per-request block tables on top of a BlockPool (vLLM v1's kv_cache_manager)."""

from __future__ import annotations

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BlockTable


class KVCacheManager:
    """Grows a request's BlockTable on demand and frees it the moment the request ends."""

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.block_tables: dict[str, BlockTable] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.block_pool.num_free_blocks

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
        return table

    def get(self, request_id: str) -> BlockTable:
        return self.block_tables[request_id]

    def free(self, request_id: str) -> int:
        """Returns the request's blocks to the pool; returns how many. Idempotent."""
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return 0
        self.block_pool.free(table.block_ids)
        return len(table.block_ids)
