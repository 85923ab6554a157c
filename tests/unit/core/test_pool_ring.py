"""HashRing: stable, balanced placement; a node leaving moves only its own keys."""

from __future__ import annotations

import pytest

from core.block_key import BlockKey
from core.pool_ring import HashRing

FP = "f" * 16


def test_placement_is_deterministic_balanced_and_moves_only_the_dead_nodes_keys():
    nodes = {"pool-a": "a:1", "pool-b": "b:1", "pool-c": "c:1"}
    ring = HashRing(nodes)
    keys = [BlockKey.content(FP, h * 0x9E3779B97F4A7C15 % 2**64) for h in range(3000)]
    owner = {k: ring.node_for(k) for k in keys}
    assert owner == {k: HashRing(dict(reversed(nodes.items()))).node_for(k) for k in keys}  # order-free
    counts = {n: list(owner.values()).count(n) for n in nodes}
    assert all(600 < c < 1400 for c in counts.values()), counts

    survivors = HashRing({"pool-a": "a:1", "pool-c": "c:1"})
    moved = [k for k in keys if survivors.node_for(k) != owner[k]]
    assert moved and all(owner[k] == "pool-b" for k in moved)  # only pool-b's keys move
    assert survivors.address_for(keys[0]) in ("a:1", "c:1")


def test_scoped_keys_spread_and_bad_rings_are_refused():
    ring = HashRing({"pool-a": "a:1", "pool-b": "b:1"})
    owners = {ring.node_for(BlockKey.scoped(FP, f"req-{i}", 0)) for i in range(50)}
    assert owners == {"pool-a", "pool-b"}
    with pytest.raises(ValueError, match="at least one"):
        HashRing({})
    with pytest.raises(ValueError, match="vnodes"):
        HashRing({"pool-a": "a:1"}, vnodes=0)
