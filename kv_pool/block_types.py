"""Values the block store hands out: reservations, events, stats, and its errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.block_key import BlockKey


class PoolFullError(Exception):
    """No room for a reservation: what is not free is leased, scoped or being written."""


class StaleReservationError(Exception):
    """The reservation was committed, aborted, or freed with its request."""


class BlockState(enum.Enum):
    WRITING = "writing"  # reserved, bytes arriving, invisible to readers
    STORED = "stored"  # committed, visible


@dataclass(frozen=True)
class BlockEvent:
    """A change of the content-addressed index, reported to ``on_event`` (for the Redis mirror)."""

    kind: str  # "stored" (in DRAM) | "demoted" (DRAM -> NVMe) | "evicted" (gone from this node)
    key: BlockKey

    @property
    def tier(self) -> str:
        """Where the block is after the event ("" when gone)."""
        return {"stored": "dram", "demoted": "nvme"}.get(self.kind, "")


@dataclass(eq=False)
class Reservation:
    """Handle of one WRITING block; compared by identity, so a stale handle cannot write."""

    key: BlockKey
    block_bytes: int
    offset_bytes: int = 0  # where the block lives in the DRAM arena (for shm / NIXL writers)


@dataclass(frozen=True)
class BlockLocation:
    """Where a STORED block's bytes are in the DRAM arena, for a peer that copies them itself."""

    offset_bytes: int
    block_bytes: int
    checksum: int  # the writer's, 0 when it gave none


class Duplicate:
    """Type of ``DUPLICATE``, the answer of a put whose key the store already holds."""

    def __repr__(self) -> str:
        return "DUPLICATE"


# Returned by ``reserve`` when the key is already stored or being written: skip the bytes.
DUPLICATE = Duplicate()


@dataclass(frozen=True)
class PoolStats:
    """Counts by state. ``stored``, ``scoped`` and ``writing`` are disjoint; ``leased`` overlays
    them (blocks held by at least one lease). Field names mirror ``GetPoolStatsResponse``."""

    capacity_bytes: int
    used_bytes: int
    num_writing_blocks: int
    num_stored_blocks: int  # committed content-addressed blocks
    num_leased_blocks: int
    num_scoped_blocks: int  # committed request-scoped blocks
    num_leases: int  # requests holding at least one lease
    num_evicted_blocks: int
    # Per tier. hits / misses: blocks looked for (leases, reads) found / not found in the
    # tier (NVMe is only asked after a DRAM miss); promotions: blocks read back from NVMe into
    # DRAM; demotions: blocks DRAM evicted into NVMe; nvme evictions: dropped from the node.
    num_dram_blocks: int = 0  # every state
    num_dram_hits: int = 0
    num_dram_misses: int = 0
    nvme_capacity_bytes: int = 0  # 0: no NVMe tier
    nvme_used_bytes: int = 0
    num_nvme_blocks: int = 0
    num_nvme_hits: int = 0
    num_nvme_misses: int = 0
    num_nvme_evictions: int = 0
    num_nvme_promotions: int = 0
    num_nvme_demotions: int = 0
    num_corrupt_blocks: int = 0  # dropped because a checksum did not match
