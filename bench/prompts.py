"""Reads prompt sets: ShareGPT JSON, AlpacaEval JSON, a JSON list of strings, or text lines."""

from __future__ import annotations

import json
from pathlib import Path

# Written for Tandem's demo and tests (not taken from any data set).
BUILTIN_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for learning a new language.",
    "What does a compiler do?",
    "Suggest a name for a friendly robot.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
]



def load_prompts(path: Path | None, limit: int, max_chars: int = 2000) -> list[str]:
    """Returns up to ``limit`` prompts of at most ``max_chars`` characters.

    ``path`` None gives the built-in prompts. Raises ValueError for a file whose format is not
    recognised, FileNotFoundError for a missing one.
    """
    if path is None:
        return BUILTIN_PROMPTS[:limit]
    text = Path(path).read_text()
    if path.suffix != ".json":
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        prompts = [_prompt_of(row) for row in json.loads(text)]
    prompts = [p for p in prompts if p and len(p) <= max_chars]
    return prompts[:limit]


def _prompt_of(row) -> str:
    if isinstance(row, str):
        return row
    if isinstance(row, dict) and "conversations" in row:  # ShareGPT
        turns = [t for t in row["conversations"] if t.get("from") in ("human", "user")]
        return turns[0]["value"] if turns else ""
    if isinstance(row, dict) and "instruction" in row:  # AlpacaEval
        return row["instruction"]
    raise ValueError(f"unrecognised prompt row: {str(row)[:80]!r}")
