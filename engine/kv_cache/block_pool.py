"""BlockPool: free list, reference counts and prefix cache of one worker's paged KV cache (vLLM).

A block is *in use* (ref count >= 1), *cached* (ref count 0, still holding the KV of a full block
whose hash is indexed, evictable least-recently-used), or *empty*. Allocation takes empty blocks
first and evicts cached ones only when it must. The pool knows nothing of requests or priorities.
"""

from __future__ import annotations

from collections import OrderedDict, deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """``num_blocks`` block ids. ``enable_caching`` False turns the prefix cache off."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._empty: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 cached blocks, LRU first
        self._ref_counts = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block id -> block hash
        self._cached: dict[int, int] = {}  # block hash -> block id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: empty plus evictable cached ones."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def lookup(self, block_hash: int) -> int | None:
        """The block holding ``block_hash``'s KV, if cached. Reads only."""
        return self._cached.get(block_hash)

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of ``block_ids`` are cached with ref count 0 (touching them uses free space)."""
        return sum(1 for b in block_ids if b in self._evictable)

    def allocate(self, n: int) -> list[int]:
        """Takes ``n`` blocks (ref count 1 each), evicting least-recently-used cached blocks if needed.

        Mutates the free lists and, on eviction, the cache index.

        Raises:
            NoFreeBlocksError: fewer than ``n`` blocks are free (nothing is taken then).
        """
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {n} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(n):
            if self._empty:
                block = self._empty.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._cached[self._hash_of.pop(block)]
                self.num_evictions += 1
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def touch(self, block_ids: list[int]) -> None:
        """Adds a reference to each (cached) block; a ref-0 block leaves the evictable list."""
        for b in block_ids:
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drops one reference from each block, last block first (so a request's tail is evicted
        before its shared prefix). A block reaching 0 stays cached if it has a hash, else empties.

        Raises:
            ValueError: a block is already free (a double free is a bug in the caller).
        """
        for b in reversed(block_ids):
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._empty.append(b)

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Indexes a full, in-use block under its hash (no-op if that hash is already cached)."""
        if not self.enable_caching or block_hash in self._cached or block_id in self._hash_of:
            return
        self._hash_of[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> int:
        """Forgets every cached hash; evictable blocks become empty. Returns how many were dropped."""
        dropped = len(self._cached)
        for b in list(self._evictable):
            self._empty.append(b)
        self._evictable.clear()
        self._hash_of.clear()
        self._cached.clear()
        return dropped
