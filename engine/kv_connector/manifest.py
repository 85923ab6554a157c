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

    def validate(self, spec: KVCacheSpec, num_prompt_tokens: int) -> None:
        """Raises ValueError when the manifest is of another KV spec, does not cover the prompt,
        or lists a wrong number of blocks."""
        if self.spec_fingerprint != spec.fingerprint:
            raise ValueError(f"manifest KV spec {self.spec_fingerprint!r} != this worker's {spec.fingerprint!r}")
        if self.num_tokens != num_prompt_tokens:
            raise ValueError(f"manifest covers {self.num_tokens} tokens, prompt has {num_prompt_tokens}")
        if len(self.keys) != -(-self.num_tokens // spec.block_size):
            raise ValueError(f"manifest lists {len(self.keys)} blocks for {self.num_tokens} tokens")
