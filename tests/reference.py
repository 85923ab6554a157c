"""The correctness reference (docs/design.md §8): Hugging Face transformers on the same checkpoint, fp32.

Loaded once per test session (cached); greedy references are cached per prompt (the longest run).
"""

from __future__ import annotations

import functools
from pathlib import Path

from core.model_source import DEFAULT_MODEL, resolve_model
from bench.prompts import BUILTIN_PROMPTS

PROMPTS = BUILTIN_PROMPTS  # eight real prompts written for Tandem's tests and demo


@functools.lru_cache(maxsize=1)
def hf_dir() -> Path:
    from engine.model.gguf_convert import ensure_hf_dir

    return ensure_hf_dir(resolve_model(DEFAULT_MODEL))


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(hf_dir())


@functools.lru_cache(maxsize=1)
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir(), dtype=torch.float32).eval()


def chat_ids(text: str) -> list[int]:
    """Token ids of a one-turn chat prompt, generation prompt added (what the router sends)."""
    ids = tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _greedy(prompt_ids: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    import torch

    with torch.inference_mode():
        out = hf_model().generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_tokens, do_sample=False,
        )
    return tuple(out[0, len(prompt_ids):].tolist())


# Each prompt's longest greedy run so far: (its tokens, the max_tokens it was asked for). Step i of
# a greedy run sees the same context however many tokens were asked, so the first n tokens of a
# longer run are the run of n tokens, and a run that ended at EOS before its max_tokens is the
# whole answer to any longer one: the tests ask the same prompts for 1 to 32 tokens, and each
# prompt is generated once (or again only for more tokens than before).
_longest: dict[tuple[int, ...], tuple[tuple[int, ...], int]] = {}


def hf_greedy(prompt_ids: list[int], max_tokens: int) -> list[int]:
    """transformers ``generate()`` greedy tokens, batch 1 (no padding), stopping at EOS like Tandem."""
    key = tuple(prompt_ids)
    tokens, asked = _longest.get(key, ((), 0))
    if asked < max_tokens and len(tokens) == asked:  # not generated this far, nor ended at EOS
        tokens, asked = _longest[key] = (_greedy(key, max_tokens), max_tokens)
    return list(tokens[:max_tokens])


@functools.lru_cache(maxsize=16)
def hf_prompt_logprobs(prompt_ids: tuple[int, ...]):
    """``log_softmax`` of transformers' logits at every prompt position: [num_prompt_tokens,
    vocab], float32 (row p predicts prompt token p + 1)."""
    import torch

    with torch.inference_mode():
        logits = hf_model()(torch.tensor([prompt_ids])).logits[0].float()
    return torch.log_softmax(logits, -1)
