"""The router loads a PreTrainedTokenizerFast folder without AutoTokenizer (which imports torch)
and tokenizes, renders chats and decodes exactly as AutoTokenizer's tokenizer does."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.model_source import DEFAULT_MODEL, resolve_model
from router.tokenizer import FAST_TOKENIZER_CLASSES, ModelTokenizer, _tokenizer_class

TEXTS = ["The capital of France is", "  leading spaces,\ttabs and\nnew lines  ", "naïve café 東京 🚀 ∑x²",
         "<|im_start|>user\nspecial tokens inside<|im_end|>", "def f(x):\n    return x ** 2  # code", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there, who are you?"}]


@pytest.fixture(scope="module")
def folder():
    try:
        source = resolve_model(DEFAULT_MODEL)
    except FileNotFoundError as err:
        pytest.skip(str(err))
    if not source.converted_dir.is_dir():
        pytest.skip("the bundled model has no converted folder yet (the first engine start writes it)")
    return source.converted_dir


def test_the_fast_tokenizer_equals_autotokenizers(folder, tokenizer: ModelTokenizer) -> None:
    from transformers import AutoTokenizer

    assert _tokenizer_class(folder) in FAST_TOKENIZER_CLASSES
    auto = AutoTokenizer.from_pretrained(folder)
    ours = tokenizer.hf
    assert type(ours) is type(auto) and len(ours) == len(auto) and ours.chat_template == auto.chat_template
    for text in TEXTS:
        ids = auto(text)["input_ids"]
        assert ours(text)["input_ids"] == ids
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids) == auto.decode(ids)
    assert (ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                          auto.pad_token_id)


def test_loading_it_imports_no_torch(folder) -> None:
    code = ("import sys; from core.model_source import resolve_model; from router.tokenizer import load_tokenizer; "
            f"load_tokenizer(resolve_model({DEFAULT_MODEL!r})); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_folder_without_a_class_is_read_as_none(tmp_path) -> None:
    assert _tokenizer_class(tmp_path) == ""
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "LlamaTokenizer"}')
    assert _tokenizer_class(tmp_path) == "LlamaTokenizer"
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert _tokenizer_class(tmp_path) == ""
