"""Layout of the pool's block index in Redis (docs/design.md §6), shared by the pool that writes it
(kv_pool/index_mirror.py) and the router that reads it (router/placement/prefix_index.py).

- hash ``tandem:kv_index:{spec_fingerprint}``: field = block hash as 16 hex chars, value =
  ``{node_id}:{tier}`` with tier ``dram`` or ``nvme`` (node ids contain no ``:``);
- stream ``tandem:kv_events``: ``{type: stored|demoted|evicted, fp, hash, node}``.
"""

from __future__ import annotations

INDEX_KEY_PREFIX = "tandem:kv_index:"
EVENTS_STREAM = "tandem:kv_events"


def index_key(spec_fingerprint: str) -> str:
    """The Redis hash holding the index of one KVCacheSpec fingerprint."""
    return f"{INDEX_KEY_PREFIX}{spec_fingerprint}"


def hash_field(block_hash: int) -> str:
    """A 64-bit block hash as 16 lower-case hex chars (the hash field)."""
    return f"{block_hash:016x}"


def index_value(node_id: str, tier: str) -> str:
    """What the index says about a block: ``{node_id}:{tier}``."""
    return f"{node_id}:{tier}"


def parse_index_value(value: str) -> tuple[str, str]:
    """(node_id, tier) of an index value; tier "" for a value without one."""
    node_id, _, tier = value.partition(":")
    return node_id, tier
