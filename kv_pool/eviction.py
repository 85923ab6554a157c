"""When the DRAM tier evicts, and how much: least recently used first, with a high/low watermark.

Placing a block (a reservation, or a promotion from NVMe) that would take DRAM occupancy above
``high`` evicts least-recently-used evictable blocks until occupancy *with the new block* is at
most ``low`` (or nothing evictable is left); a block that does not fit at all evicts on demand
until it does. Evicting in one batch down to ``low`` keeps headroom for the next burst of
writes, so most placements evict nothing (the usual high/low watermark scheme of page caches)::

    0            low                high      capacity_bytes
    |-------------|------------------|---------|
                  ^ evict down to    ^ a placement that would pass this evicts

Only evictable blocks are candidates: STORED, content-addressed, unleased (the LRU set holds
nothing else), so a leased block, a block mid-write and a request-scoped block are never
evicted. Pure arithmetic here; the tiers do the moving.
"""

from __future__ import annotations

from dataclasses import dataclass

from kv_pool.lru import LruSet


@dataclass(frozen=True)
class Watermarks:
    """DRAM occupancy fractions: ``0 < low <= high <= 1``. ``high`` = 1 evicts only on demand.

    Raises:
        ValueError: quoting the value, when a fraction is out of range or ``low`` > ``high``.
    """

    high: float = 0.95
    low: float = 0.85

    def __post_init__(self) -> None:
        if not 0 < self.high <= 1:
            raise ValueError(f"high watermark must be in (0, 1], got {self.high!r}")
        if not 0 < self.low <= 1:
            raise ValueError(f"low watermark must be in (0, 1], got {self.low!r}")
        if self.low > self.high:
            raise ValueError(f"low watermark {self.low!r} must not exceed the high watermark {self.high!r}")


# Evict only when a block does not fit (no headroom kept): what a store without watermarks does.
ON_DEMAND = Watermarks(high=1.0, low=1.0)


def num_bytes_to_evict(
    used_bytes: int, new_bytes: int, capacity_bytes: int, watermarks: Watermarks
) -> int:
    """Bytes to evict before placing ``new_bytes`` next to ``used_bytes`` (0: none).

    Above ``high`` after the placement: down to ``low``. Otherwise just what does not fit.
    """
    after_bytes = used_bytes + new_bytes
    if after_bytes > watermarks.high * capacity_bytes:
        return max(0, after_bytes - int(watermarks.low * capacity_bytes))
    return max(0, after_bytes - capacity_bytes)


def pick_victims(lru: LruSet, num_bytes: int) -> list:
    """Pops least recently used keys of ``lru`` until they add up to ``num_bytes`` (or it is
    empty); returns them oldest first. Mutates: ``lru``."""
    victims, freed_bytes = [], 0
    while freed_bytes < num_bytes and lru:
        key, size_bytes = lru.pop_oldest_with_size()
        victims.append(key)
        freed_bytes += size_bytes
    return victims
