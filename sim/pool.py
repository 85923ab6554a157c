"""The simulated KV pool: which content-addressed full blocks it holds, LRU-evicted at capacity
(kv_pool's DRAM tier; leases and the NVMe tier are not modelled)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SimPool:
    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.num_query_blocks = 0
        self.num_hit_blocks = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def num_leading(self, block_hashes: Sequence[int]) -> int:
        """How many leading blocks of a chain the pool holds. Reads only."""
        n = 0
        for h in block_hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def load(self, block_hashes: Sequence[int]) -> int:
        """A prefill worker reads the leading blocks it can: returns how many; counts the hit
        rate and marks them recently used."""
        n = self.num_leading(block_hashes)
        for h in block_hashes[:n]:
            self._blocks.move_to_end(h)
        self.num_query_blocks += len(block_hashes)
        self.num_hit_blocks += n
        return n

    def store(self, block_hashes: Sequence[int]) -> None:
        """Commits blocks (already present ones are refreshed); evicts least recently used ones
        beyond capacity."""
        for h in block_hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_blocks / self.num_query_blocks if self.num_query_blocks else float("nan")
