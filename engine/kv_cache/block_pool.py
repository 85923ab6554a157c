"""BlockPool: the free list and reference counts of one worker's paged KV cache (vLLM).

It hands out block ids and takes them back; it knows nothing of requests or priorities.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """``num_blocks`` block ids; each allocated id has a reference count >= 1."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` free blocks (ref count 1 each). Mutates the free list.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken then).
        """
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference from each block; a block whose count reaches 0 is free again.

        Raises:
            ValueError: a block is already free (a double free is a bug in the caller).
        """
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
