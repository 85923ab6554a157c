"""Incremental, UTF-8-safe detokenization of a request's output tokens.

A byte-level tokenizer splits one character (an emoji, a CJK ideograph) over several tokens; the
first of them decode alone to U+FFFD. Decoding only a short window of recent tokens and emitting
text once it no longer ends in U+FFFD keeps each step O(window) and never sends half a character
(the prefix/read offset technique of vLLM and TGI)::

    token_ids:  [ emitted ........ | prefix_offset ......... | read_offset ....... ]
                                     already emitted, decoded    new: decoded and
                                     again as context            emitted once whole
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    The concatenation of every :meth:`add` result and the final :meth:`flush` equals
    ``decode(all output ids)``; ``decode`` must skip special tokens the way the caller wants.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # first token whose text was not emitted yet
        self.text = ""  # everything emitted so far

    def add(self, token_ids: Iterable[int]) -> str:
        """Appends ``token_ids`` and returns the newly complete text ("" while a character is
        still partial). Mutates ``token_ids``, the offsets and ``text``."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new yet, or the last character is still incomplete
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """Returns whatever text is still held back (a trailing partial character decodes to
        U+FFFD here, as in the full decode). Call once, when the request ends."""
        full = self._decode(self.token_ids)
        if not full.startswith(self.text):
            log.warning("incremental text diverged from the full decode: %r vs %r", self.text, full)
            return ""
        delta = full[len(self.text) :]
        self.prefix_offset = self.read_offset = len(self.token_ids)
        self.text = full
        return delta
