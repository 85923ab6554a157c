"""Router unit-test fixtures: the real SmolLM2 tokenizer, loaded once per session."""

from __future__ import annotations

import pytest

from core.model_source import DEFAULT_MODEL, resolve_model
from router.tokenizer import ModelTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> ModelTokenizer:
    """The bundled model's tokenizer (converted folder if present, else read from the GGUF)."""
    try:
        source = resolve_model(DEFAULT_MODEL)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    return load_tokenizer(source)
