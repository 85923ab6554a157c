"""Which pool node holds a block: consistent hashing of the block key over the live pool nodes.

Every worker builds the same ring from the same registry, so the prefill worker that writes a
block and the decode worker that reads it agree on its node without asking anyone. When a node
joins or dies only the keys of its arcs move (``vnodes`` points per node keep arcs even); blocks
whose node changed are simply not found there and get recomputed (docs/design.md §1).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Mapping

from core.block_key import BlockKey


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def key_point(key: BlockKey) -> int:
    """Where ``key`` sits on the ring (64-bit). A content key's hash is already uniform."""
    if key.block_hash is not None:
        return _point(f"{key.spec_fingerprint}/{key.block_hash:016x}")
    return _point(f"{key.spec_fingerprint}/{key.request_id}/{key.block_index}")


class HashRing:
    """``nodes``: node id -> address. Immutable; build a new one when membership changes.

    Raises:
        ValueError: no nodes, or ``vnodes`` < 1.
    """

    def __init__(self, nodes: Mapping[str, str], vnodes: int = 64):
        if not nodes:
            raise ValueError("a hash ring needs at least one pool node")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes!r}")
        self.nodes = dict(nodes)
        points = sorted((_point(f"{node_id}#{i}"), node_id) for node_id in self.nodes for i in range(vnodes))
        self._points = [p for p, _ in points]
        self._owners = [node_id for _, node_id in points]

    @property
    def addresses(self) -> list[str]:
        return sorted(set(self.nodes.values()))

    def node_for(self, key: BlockKey) -> str:
        """The node id owning ``key``: the first ring point at or after the key's point."""
        i = bisect.bisect_left(self._points, key_point(key)) % len(self._points)
        return self._owners[i]

    def address_for(self, key: BlockKey) -> str:
        return self.nodes[self.node_for(key)]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashRing) and self.nodes == other.nodes
