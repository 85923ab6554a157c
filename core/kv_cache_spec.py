"""What a KV block *is*: the spec that namespaces every key in the pool (docs/design.md §4)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_LAYOUTS = ("all_heads",)


@dataclass(frozen=True)
class KVCacheSpec:
    """Layout of one KV block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of ``dtype``.

    Two caches can exchange blocks only when their specs are equal; the fingerprint enforces it.

    ``kv_layout`` is the tensor-parallel layout of a block's bytes. The one layout is
    ``"all_heads"``: a block holds every KV head in head order whatever the writer's
    tensor-parallel size (a TP worker's ranks join their heads before a write and split them
    after a read, engine.parallel.runner), so workers of any TP degree share blocks and prefix
    hits, and the TP degree is deliberately not part of the fingerprint. A layout that stored
    each rank's heads as separate blocks would get its own name, and so its own namespace.

    Raises:
        ValueError: for an unknown dtype or a non-positive size.
    """

    model_id: str
    revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_layout: str = "all_heads"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, K and V)."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]
        )

    @property
    def fingerprint(self) -> str:
        """16 hex chars identifying the spec; namespaces every pool key."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()
