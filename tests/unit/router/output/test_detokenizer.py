"""Incremental detokenization never emits half a character and reproduces the full decode."""

from __future__ import annotations

import pytest

from router.output.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

MULTIBYTE_TEXT = "Café ☕ — 👋🏽 hi 世界 日本語のテキスト, 👨‍👩‍👧 family! 한국어 done."


def byte_decode(ids: list[int]) -> str:
    """A toy tokenizer whose every token is one UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def test_byte_tokens_wait_for_whole_characters() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    ids = list("hé€".encode())  # h (1 byte), é (2 bytes), € (3 bytes)
    assert [detok.add([i]) for i in ids] == ["h", "", "é", "", "", "€"]
    assert detok.flush() == ""
    assert detok.text == "hé€"


def test_trailing_partial_character_is_flushed_as_in_the_full_decode() -> None:
    detok = IncrementalDetokenizer(byte_decode)
    ids = list("a€".encode())[:-1]  # generation stopped inside €
    assert [detok.add([i]) for i in ids] == ["a", "", ""]
    assert detok.flush() == byte_decode(ids)[1:] == REPLACEMENT_CHAR


def test_real_tokenizer_splits_characters_across_tokens(tokenizer) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    # The test is only meaningful if some single tokens are partial characters.
    assert sum(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids) >= 5


@pytest.mark.parametrize("chunk", [1, 2, 3, 7])
def test_real_tokenizer_stream_equals_full_decode(tokenizer, chunk: int) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT)
    deltas = stream(IncrementalDetokenizer(tokenizer.decode), ids, chunk)
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == MULTIBYTE_TEXT


def test_special_tokens_are_skipped(tokenizer) -> None:
    eos = min(tokenizer.eos_token_ids)
    ids = tokenizer.encode("Hello 世界") + [eos] + tokenizer.encode(" again")
    deltas = stream(IncrementalDetokenizer(tokenizer.decode), ids, 1)
    assert "".join(deltas) == tokenizer.decode(ids) == "Hello 世界 again"
