"""A KV manifest as domain data: which pool blocks hold a prompt's KV (docs/design.md §2 step 3)."""

from __future__ import annotations

from dataclasses import dataclass

from core.block_key import BlockKey
from core.kv_cache_spec import KVCacheSpec


@dataclass(frozen=True)
class Manifest:
    """What a prefill worker wrote for a request: one key per prompt block (full blocks
    content-addressed, the tail request-scoped), covering ``num_tokens`` tokens."""

    spec_fingerprint: str
    # One pool node's address; "" when the blocks are spread over the pool's ring.
    pool_address: str
    keys: list[BlockKey]
    num_tokens: int
    # The blocks' K/V dtype (KVCacheSpec.kv_dtype_name: "float32", ..., "fp8", "int8"); "" from a
    # sender that does not say.
    kv_dtype: str = ""

    def validate(self, spec: KVCacheSpec, num_prompt_tokens: int) -> None:
        """Raises ValueError when the manifest is of another KV spec (naming both KV dtypes when
        they differ: blocks of one KV dtype are never read as another's), does not cover the
        prompt, or lists a wrong number of blocks."""
        if self.kv_dtype and self.kv_dtype != spec.kv_dtype_name:
            raise ValueError(f"manifest KV blocks are {self.kv_dtype}, this worker's KV cache is "
                             f"{spec.kv_dtype_name}: prefill and decode workers need the same --kv-cache-dtype "
                             f"(and --dtype)")
        if self.spec_fingerprint != spec.fingerprint:
            raise ValueError(f"manifest KV spec {self.spec_fingerprint!r} != this worker's {spec.fingerprint!r}")
        if self.num_tokens != num_prompt_tokens:
            raise ValueError(f"manifest covers {self.num_tokens} tokens, prompt has {num_prompt_tokens}")
        if len(self.keys) != -(-self.num_tokens // spec.block_size):
            raise ValueError(f"manifest lists {len(self.keys)} blocks for {self.num_tokens} tokens")
