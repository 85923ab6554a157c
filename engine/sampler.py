"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws token ``i`` from a generator seeded by ``(seed, i)``, so its text does not
depend on its batch, nor on which worker (prefill or decode) samples which token.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from core.request import Request
from engine.outputs import SampledToken


def token_seed(seed: int, output_index: int) -> int:
    """63-bit seed of output token ``output_index`` of a request seeded with ``seed``."""
    digest = hashlib.blake2b(struct.pack("<QQ", seed % 2**64, output_index), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Masks ``logits`` ([vocab], float32) outside the top-k / nucleus to -inf; returns a new tensor."""
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p
        logits[order[drop]] = float("-inf")
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
        """Picks one token per row of ``logits`` ([num_seqs, vocab], float32) for ``requests[i]``.

        A request's ``num_output_tokens`` is the index of the token being sampled (its seed input).
        """
        logits = logits.cpu()
        greedy = logits.argmax(-1).tolist()
        tokens = []
        for i, request in enumerate(requests):
            p = request.sampling_params
            if p.greedy:
                tokens.append(SampledToken(greedy[i]))
                continue
            masked = apply_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
            probs = masked.softmax(-1)
            gen = self.generator
            if p.seed is not None:
                gen = torch.Generator().manual_seed(token_seed(p.seed, request.num_output_tokens))
            tokens.append(SampledToken(int(torch.multinomial(probs, 1, generator=gen))))
        return tokens
