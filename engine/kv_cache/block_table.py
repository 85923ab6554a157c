"""BlockTable: the block ids holding one request's tokens, in order."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BlockTable:
    """Token ``p`` of the request lives at ``slot(p) = block_ids[p // block_size] * block_size + p % block_size``."""

    block_size: int
    block_ids: list[int] = field(default_factory=list)

    @property
    def capacity_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Extra blocks needed so that ``num_tokens`` tokens fit."""
        return max(0, -(-num_tokens // self.block_size) - len(self.block_ids))

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of token positions ``[start, end)``; they must be within capacity."""
        bs = self.block_size
        return [self.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
