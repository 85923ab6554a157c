"""How a request reaches a decode worker, as domain data: what the Decode RPC hands over.

Three ways, told apart by what comes with the prompt:

- disaggregated: a :class:`Manifest` of the prompt's KV in the pool and the first token (the
  prefill worker's); the decode worker's connector takes the request's pool state over;
- resumed: the output tokens so far (another decode worker failed mid-stream); the connector
  loads whatever prefix the pool still holds, the engine recomputes the rest;
- colocated: nothing; the engine prefills the prompt itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from core.kv_cache_spec import KVCacheSpec
from core.request import Request
from engine.kv_connector.manifest import Manifest


@dataclass(frozen=True)
class DecodeStart:
    manifest: Manifest | None = None  # disaggregated: the prompt's blocks in the pool ...
    first_token_id: int | None = None  # ... and the first token, sampled by the prefill worker
    output_token_ids: tuple[int, ...] = ()  # resumed: the tokens generated before the failure

    def validate(self, spec: KVCacheSpec, num_prompt_tokens: int) -> None:
        """Raises ValueError when the pieces do not fit one of the three ways, or the manifest
        is of another KV spec or does not cover the prompt."""
        if (self.first_token_id is None) != (self.manifest is None):
            raise ValueError("first_token_id and manifest come together (disaggregated) or not at all (colocated)")
        if self.output_token_ids and self.manifest is not None:
            raise ValueError("output_token_ids resume a request: they come without first_token_id and manifest")
        if self.manifest is not None:
            self.manifest.validate(spec, num_prompt_tokens)


def append_outputs(request: Request, output_token_ids: Sequence[int]) -> None:
    """Appends a resumed request's tokens so far (they count toward max_tokens and min_tokens).
    Mutates ``request``. Raises ValueError when they run past the request's end (a stop token or
    max_tokens before the last one)."""
    for i, token_id in enumerate(output_token_ids):
        if request.append_output_token(token_id) is not None and i < len(output_token_ids) - 1:
            raise ValueError(f"output_token_ids end the request at index {i} of {len(output_token_ids)} "
                             f"({request.finish_reason.value})")
