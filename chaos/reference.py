"""Greedy reference answers from Hugging Face transformers on the same checkpoint (docs/design.md §8).

Computed once per (prompt, max_tokens) and cached in a JSON file, so a campaign pays for them
only on its first run. torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from bench.workloads import BenchRequest


def _key(request: BenchRequest) -> str:
    text = json.dumps([request.prompt, request.max_tokens])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def references(requests: list[BenchRequest], model: str, cache_path: Path) -> dict[str, str]:
    """The reference text of each distinct request, by :func:`reference_key`; cached in
    ``cache_path`` (read, completed, written back). Chat prompts go through the chat template,
    token-id prompts as they are; greedy, batch 1, stopping at EOS; special tokens skipped."""
    cache = json.loads(cache_path.read_text()) if cache_path.exists() else {}
    missing = list({_key(r): r for r in requests if _key(r) not in cache}.values())  # each distinct once
    if missing:
        tokenizer, hf = _load(model)
        for request in missing:
            cache[_key(request)] = _greedy_text(tokenizer, hf, request)
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        cache_path.write_text(json.dumps(cache, indent=0))
    return {_key(r): cache[_key(r)] for r in requests}


def reference_key(request: BenchRequest) -> str:
    return _key(request)


def _load(model: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.model_source import resolve_model
    from engine.model.gguf_convert import ensure_hf_dir

    hf_dir = ensure_hf_dir(resolve_model(model))
    # One thread: batch-1 generation of a small model gains little from more, and a multi-threaded
    # torch on a loaded machine spins at its barriers (10-100x slower; launcher.commands.worker_threads).
    torch.set_num_threads(1)
    return AutoTokenizer.from_pretrained(hf_dir), AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def _greedy_text(tokenizer, hf, request: BenchRequest) -> str:
    import torch

    if isinstance(request.prompt, str):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": request.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    else:
        ids = list(request.prompt)
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=request.max_tokens, do_sample=False)
    return tokenizer.decode(out[0, len(ids):].tolist(), skip_special_tokens=True)
