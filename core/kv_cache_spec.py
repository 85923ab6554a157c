"""What a KV block *is*: the spec that namespaces every key in the pool (docs/design.md §4)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_LAYOUTS = ("all_heads",)
# The KV cache's element type (vLLM's --kv-cache-dtype): "auto" stores K/V in the model's dtype;
# "fp8" (float8 e4m3fn) and "int8" store 8-bit values with one float32 scale per token and head.
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
# An 8-bit head row: head_dim 8-bit values, then the row's float32 scale (little-endian).
KV_SCALE_BYTES = 4
KV_SCALE_LAYOUT = "per_token_head_f32_after_row"


def kv_head_row_bytes(head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one (token, KV head) row of K or of V: ``head_dim`` values of ``dtype_bytes``
    bytes each (``auto``), or with an 8-bit ``kv_cache_dtype`` (fp8, int8) ``head_dim`` one-byte
    values followed by their float32 scale (``head_dim + KV_SCALE_BYTES``).

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return head_dim + KV_SCALE_BYTES
    return head_dim * dtype_bytes


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int,
                       kv_cache_dtype: str = "auto") -> int:
    """Bytes of one token's K and V in every layer and KV head (scales included when 8-bit):
    ``2 * num_layers * num_kv_heads * kv_head_row_bytes(...)``. A block of ``block_size`` tokens
    is ``block_size`` times this (:attr:`KVCacheSpec.block_bytes`). For head_dim 128: a 256-byte
    row in bfloat16, a 132-byte one in fp8 / int8.

    Raises:
        ValueError: an unknown ``kv_cache_dtype``.
    """
    return 2 * num_layers * num_kv_heads * kv_head_row_bytes(head_dim, dtype_bytes, kv_cache_dtype)


@dataclass(frozen=True)
class KVCacheSpec:
    """Layout of one KV block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` of ``dtype``,
    or with an 8-bit ``kv_cache_dtype`` ``[num_layers, 2, block_size, num_kv_heads, head_dim + 4]``
    bytes: each (token, head) row is ``head_dim`` fp8 / int8 values followed by its float32 scale
    (``value = q * scale``). The scales travel inside the block, so whatever moves a block's bytes
    (pool, swap, copy-on-write, a tensor-parallel cut by heads) moves its scales with it.

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
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def quantized(self) -> bool:
        """Whether K/V are stored as 8-bit values with per-(token, head) scales."""
        return self.kv_cache_dtype != "auto"

    @property
    def kv_dtype_name(self) -> str:
        """What a block's K/V values are: the model's dtype ("float32", ...), "fp8" or "int8"."""
        return self.kv_cache_dtype if self.quantized else self.dtype

    @property
    def head_row_bytes(self) -> int:
        """Bytes of one (token, KV head) row: values, plus the scale when quantized."""
        return kv_head_row_bytes(self.head_dim, DTYPE_BYTES[self.dtype], self.kv_cache_dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (all layers, K and V, and their scales when quantized)."""
        return self.block_size * kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_dim,
                                                    DTYPE_BYTES[self.dtype], self.kv_cache_dtype)

    @property
    def fingerprint(self) -> str:
        """16 hex chars identifying the spec; namespaces every pool key.

        An 8-bit spec adds its KV dtype and scale layout to the hashed fields; an ``auto`` spec
        hashes the fields it always had, so float blocks keep the keys they had before 8-bit
        KV existed.
        """
        fields = asdict(self)
        if self.quantized:
            fields["kv_scale_layout"] = KV_SCALE_LAYOUT
        else:
            del fields["kv_cache_dtype"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.blake2b(blob, digest_size=8).hexdigest()

    def describe(self) -> str:
        """A short human label of what the blocks hold, for error messages: e.g. ``KV fp8 (model
        float32), fingerprint 1a2b...``."""
        return f"KV {self.kv_dtype_name} (model {self.dtype}), fingerprint {self.fingerprint}"
