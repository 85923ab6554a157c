"""Token sampling: penalties, min_tokens, greedy, temperature, min-p, top-k, top-p, per-request
seeds, log-probabilities.

A seeded request draws token ``i`` from a generator seeded by ``(seed, i)``, so its text does not
depend on its batch, nor on which worker (prefill or decode) samples which token.

Each row goes through (vLLM's order)::

    raw logits -> grammar mask (structured outputs) -> min_tokens mask -> repetition / frequency / presence penalties = processed logits
    processed -> argmax                                   (greedy)
    processed -> / temperature -> min-p -> top-k, top-p -> draw    (sampled; min-p batched)

Log-probabilities are the ``log_softmax`` of the *processed* logits: penalised and masked, but
before temperature, top-k and top-p. A row that needs no processing skips it (the greedy fast
path is one batched argmax). The grammar mask of every structured row is applied in one
vectorised call (``engine.structured_output.TokenMask``), so a structured greedy row stays on
the fast path.
"""

from __future__ import annotations

import hashlib
import struct

import torch

from engine.kernels import cpu_elementwise
from engine.outputs import PromptLogprobsInput, SampledToken, SamplingInput
from engine.structured_output import TokenMask


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """``logits.argmax(-1)`` ([num_seqs, vocab] CPU) as a list: through the C argmax for float32
    (engine.kernels.cpu_elementwise.argmax_rows, the same indices as torch's, ties and NaN
    included), torch's otherwise."""
    kernel = cpu_elementwise.usable(logits) if logits.dtype == torch.float32 and logits.dim() == 2 \
        and logits.shape[1] > 0 else None
    if kernel is None:
        return logits.argmax(-1).tolist()
    return cpu_elementwise.argmax_rows(kernel, logits).tolist()


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


def apply_min_p(logits: torch.Tensor, temperatures: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """vLLM's min-p over a batch in one step: masks to -inf each token whose probability at its
    row's temperature is below ``min_p`` times the row's most likely token's, that is
    ``(logit - max_logit) / T < log(min_p)``. Rows with ``min_p`` 0 or temperature 0 (greedy) are
    kept whole. Returns ``logits`` itself when no row is masked, else a new tensor.

    Args:
        logits: [num_seqs, vocab], float32, processed (penalised), before temperature.
        temperatures: [num_seqs], float32.
        min_ps: [num_seqs], float32 in [0, 1].
    """
    active = (min_ps > 0) & (temperatures > 0)
    if not bool(active.any()):
        return logits
    with torch.no_grad():
        floor = logits.max(-1, keepdim=True).values + (temperatures * torch.log(min_ps)).unsqueeze(-1)
        drop = (logits < floor) & active.unsqueeze(-1)  # an inactive row's floor may be NaN: never dropped
    return logits.masked_fill(drop, float("-inf"))


def needs_processing(request: SamplingInput) -> bool:
    """True when the row's logits must be changed (penalties, min_tokens) before sampling."""
    p = request.sampling_params
    return p.has_penalties or (request.num_output_tokens < p.min_tokens and bool(request.stop_token_ids))


def apply_penalties(
    logits: torch.Tensor, prompt_token_ids: list[int], output_token_ids: list[int],
    presence: float, frequency: float, repetition: float,
) -> torch.Tensor:
    """vLLM's penalties on ``logits`` ([vocab], float32); returns a new tensor.

    Repetition (over prompt and output tokens): a positive logit is divided by ``repetition``, a
    negative one multiplied. Then, over output tokens only: ``logit -= frequency * count +
    presence * (count > 0)``.
    """
    logits = logits.clone()
    vocab = logits.numel()
    if repetition != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[torch.tensor(prompt_token_ids + output_token_ids, dtype=torch.long)] = True
        scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, scaled, logits)
    if (presence or frequency) and output_token_ids:
        counts = torch.bincount(torch.tensor(output_token_ids, dtype=torch.long), minlength=vocab)[:vocab]
        logits -= frequency * counts.to(logits.dtype) + presence * (counts > 0).to(logits.dtype)
    return logits


def process_logits(logits: torch.Tensor, request: SamplingInput) -> torch.Tensor:
    """The request's processed logits ([vocab], float32, a new tensor): stop tokens masked to
    -inf while it is under ``min_tokens``, then penalties."""
    p = request.sampling_params
    if request.num_output_tokens < p.min_tokens and request.stop_token_ids:
        logits = logits.clone()
        logits[[t for t in request.stop_token_ids if t < logits.numel()]] = float("-inf")
    if p.has_penalties:
        logits = apply_penalties(
            logits, request.prompt_token_ids, request.output_token_ids,
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
        )
    return logits


def with_logprobs(logits: torch.Tensor, token_id: int, num_top: int) -> SampledToken:
    """``token_id`` with its log-probability and the ``num_top`` best (token, logprob) pairs, best
    first, all from ``log_softmax(logits)`` ([vocab], float32)."""
    logprobs = torch.log_softmax(logits.float(), -1)
    top: tuple[tuple[int, float], ...] = ()
    if num_top:
        values, ids = torch.topk(logprobs, num_top)
        # A grammar may allow fewer than num_top tokens: the masked ones (-inf) are not listed.
        top = tuple((t, v) for t, v in zip(ids.tolist(), values.tolist()) if v != float("-inf"))
    return SampledToken(token_id, float(logprobs[token_id]), top)


def prompt_logprobs(logits: torch.Tensor, rows: list[tuple[str, PromptLogprobsInput]]) -> dict[str, list[SampledToken]]:
    """Each request's prompt-token log-probabilities, all rows in one ``log_softmax``.

    Args:
        logits: [sum of len(target_token_ids), vocab], float32: row ``k`` of a request is the
            logits of its ``k``-th position in the step (raw: no penalty applies to a prompt).
        rows: (request_id, what its positions predict), in the order of ``logits``' rows.
    """
    if not rows:
        return {}
    logprobs = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor([t for _, spec in rows for t in spec.target_token_ids], device=logprobs.device)
    chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
    max_top = max(spec.num_top for _, spec in rows)
    top_values, top_ids = (torch.topk(logprobs, max_top) if max_top else (logprobs[:, :0], logprobs[:, :0]))
    top_values, top_ids = top_values.tolist(), top_ids.long().tolist()
    out, row = {}, 0
    for request_id, spec in rows:
        tokens = []
        for target in spec.target_token_ids:
            top = tuple(zip(top_ids[row][: spec.num_top], top_values[row][: spec.num_top]))
            tokens.append(SampledToken(target, chosen[row], top))
            row += 1
        out[request_id] = tokens
    return out


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: torch.Tensor, requests: list[SamplingInput],
               mask: TokenMask | None = None) -> list[SampledToken]:
        """Picks one token per row of ``logits`` ([num_seqs, vocab], float32) for ``requests[i]``
        (a SamplingInput, or anything with its fields: a core Request reads the same).

        A request's ``num_output_tokens`` is the index of the token being sampled (its seed input,
        and what ``min_tokens`` compares with). ``mask``: the structured rows' allowed tokens;
        their other logits are set to -inf in place. Otherwise reads, never mutates, ``logits``
        and ``requests``.
        """
        logits = logits.cpu()
        if mask is not None:
            mask.apply(logits)
        rows = [i for i, request in enumerate(requests) if needs_processing(request)]
        if rows:
            logits = logits.clone()
            for i in rows:
                logits[i] = process_logits(logits[i], requests[i])
        greedy = greedy_tokens(logits)
        params = [request.sampling_params for request in requests]
        drawn = apply_min_p(logits, torch.tensor([p.temperature for p in params], dtype=torch.float32),
                            torch.tensor([p.min_p for p in params], dtype=torch.float32))
        tokens = []
        for i, request in enumerate(requests):
            p = params[i]
            token_id = greedy[i] if p.greedy else self._draw(drawn[i], request)
            tokens.append(SampledToken(token_id) if p.logprobs is None else with_logprobs(logits[i], token_id, p.logprobs))
        return tokens

    def _draw(self, logits: torch.Tensor, request: SamplingInput) -> int:
        """Draws from ``logits`` ([vocab], float32, processed and min-p masked) at the request's
        temperature, top-k and top-p; a seeded request uses its own generator for this token index."""
        p = request.sampling_params
        masked = apply_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
        gen = self.generator
        if p.seed is not None:
            gen = torch.Generator().manual_seed(token_seed(p.seed, request.num_output_tokens))
        return int(torch.multinomial(masked.softmax(-1), 1, generator=gen))
