"""Token-id prompts synthesized from trace rows, with the trace's prefix sharing made exact.

A Mooncake row's ``hash_ids`` name its prompt blocks; two rows share their KV prefix exactly as far
as their leading hash ids agree. The synthesizer keeps that promise in tokens:

    row A: [h0 | h1 | h2 | h3]        block = block_tokens tokens, the last one may be partial
    row B: [h0 | h1 | h7 ]
            ^^^^^^^^^ identical tokens (2 x block_tokens); h2 and h7 differ at their first token

The first token of a block is its rank among the blocks seen after the same prefix (a trie), so
siblings always differ there; the other tokens are drawn from a generator seeded by (seed, hash id).
Rows without hash ids get random tokens of their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRow


@dataclass(frozen=True)
class SynthesisConfig:
    length_scale: float = 1.0  # input lengths and the hash block are multiplied by this (e.g. 1/32)
    output_scale: float | None = None  # output lengths; None: same as length_scale
    token_low: int = 1000  # prompt token ids are drawn from [token_low, token_high): no special tokens
    token_high: int = 30000  # below every common vocabulary size (Llama 32000, SmolLM2 49152)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length_scale <= 0 or (self.output_scale is not None and self.output_scale <= 0):
            raise ValueError(f"scales must be > 0, got {self.length_scale}, {self.output_scale}")
        block = MOONCAKE_BLOCK_TOKENS * self.length_scale
        if abs(block - round(block)) > 1e-9 or round(block) < 1:
            raise ValueError(f"length_scale {self.length_scale} must make the 512-token hash block a whole "
                             f"number of tokens (got {block})")
        if not 0 <= self.token_low < self.token_high:
            raise ValueError(f"bad token range [{self.token_low}, {self.token_high})")

    @property
    def block_tokens(self) -> int:
        return round(MOONCAKE_BLOCK_TOKENS * self.length_scale)

    def scale_input(self, tokens: int) -> int:
        # ceil keeps len(hash_ids) == ceil(input / block) true after scaling.
        return max(1, math.ceil(tokens * self.length_scale - 1e-9))

    def scale_output(self, tokens: int) -> int:
        scale = self.length_scale if self.output_scale is None else self.output_scale
        return max(1, math.ceil(tokens * scale - 1e-9))


class PrefixSynthesizer:
    """Builds prompts; remembers the block trie so later rows reuse earlier rows' blocks."""

    def __init__(self, config: SynthesisConfig):
        self.config = config
        # trie: node id -> {hash id: child node id}; node 0 is the empty prefix.
        self._children: dict[int, dict[int, int]] = {0: {}}
        self._first_token: dict[int, int] = {}
        self._next_node = 1

    def prompt(self, row: TraceRow, index: int) -> list[int]:
        """``row.input_tokens`` scaled, as token ids. ``index`` seeds rows without hash ids.

        Mutates the trie (new blocks get the next sibling rank). Raises ValueError when a prefix has
        more distinct next blocks than the token range can tell apart.
        """
        num_tokens = self.config.scale_input(row.input_tokens)
        if not row.hash_ids:
            rng = np.random.default_rng([self.config.seed, 1, index])
            return rng.integers(self.config.token_low, self.config.token_high, num_tokens).tolist()
        block = self.config.block_tokens
        tokens: list[int] = []
        node = 0
        for hash_id in row.hash_ids:
            if len(tokens) >= num_tokens:
                break
            node = self._child(node, hash_id)
            tokens.extend(self._block(node, hash_id)[: num_tokens - len(tokens)])
        if len(tokens) < num_tokens:
            raise ValueError(f"row {index}: {len(row.hash_ids)} hash ids cannot cover {num_tokens} tokens "
                             f"at {block} tokens a block")
        return tokens

    def _child(self, parent: int, hash_id: int) -> int:
        children = self._children[parent]
        if hash_id not in children:
            rank = len(children)
            if rank >= self.config.token_high - self.config.token_low:
                raise ValueError(f"more than {rank} distinct blocks follow one prefix; widen the token range")
            node = self._next_node
            self._next_node += 1
            children[hash_id] = node
            self._children[node] = {}
            self._first_token[node] = self.config.token_low + rank
        return children[hash_id]

    def _block(self, node: int, hash_id: int) -> list[int]:
        c = self.config
        rng = np.random.default_rng([c.seed, 0, hash_id])
        rest = rng.integers(c.token_low, c.token_high, c.block_tokens - 1).tolist()
        return [self._first_token[node], *rest]
