"""Domain form of a pool key (proto ``tandem.v1.BlockKey``), usable as a dict key."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockKey:
    """Either a content-addressed full block (``block_hash``) or a request-scoped partial block
    (``request_id`` + ``block_index``), inside one ``KVCacheSpec`` fingerprint.

    Raises:
        ValueError: unless exactly one of the two identities is given.
    """

    spec_fingerprint: str
    block_hash: int | None = None
    request_id: str | None = None
    block_index: int | None = None

    def __post_init__(self) -> None:
        scoped = self.request_id is not None
        if scoped == (self.block_hash is not None) or scoped != (self.block_index is not None):
            raise ValueError(f"a BlockKey needs block_hash xor (request_id, block_index): {self}")

    @property
    def is_scoped(self) -> bool:
        return self.request_id is not None

    @classmethod
    def content(cls, spec_fingerprint: str, block_hash: int) -> BlockKey:
        return cls(spec_fingerprint, block_hash=block_hash)

    @classmethod
    def scoped(cls, spec_fingerprint: str, request_id: str, block_index: int) -> BlockKey:
        return cls(spec_fingerprint, request_id=request_id, block_index=block_index)
