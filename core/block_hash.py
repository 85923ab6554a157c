"""Content addressing of full KV blocks by a hash chain (docs/design.md §4, vLLM prefix caching).

``block_hash[i] = H(block_hash[i-1], token_ids of block i, extra_keys)``: one hash names the whole
prefix up to and including its block, so two prompts share block ``i`` only if they share every
token before it. H is BLAKE2b with an 8-byte digest: stable across processes and machines
(Python's ``hash()`` is salted per process and must never be used here).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_PARENT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: bytes = b"") -> int:
    """Returns the 64-bit hash of one full block given its parent's hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<Q", parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}i", *token_ids))
    h.update(extra_keys)
    return int.from_bytes(h.digest(), "little")


def hash_block_chain(token_ids: Sequence[int], block_size: int, extra_keys: bytes = b"") -> list[int]:
    """Hashes every *full* block of ``token_ids``; the partial tail gets no hash.

    Returns ``len(token_ids) // block_size`` hashes.

    Raises:
        ValueError: if block_size < 1.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = ROOT_PARENT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes
