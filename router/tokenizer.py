"""The served model's tokenizer and its end-of-sequence tokens (no model weights, no torch)."""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from core.model_source import ModelSource
from router.chat_templates import TOOL_TEMPLATE, bundled_template

log = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@dataclass(frozen=True)
class ChatOptions:
    """How a chat is rendered into a prompt (vLLM's chat request fields).

    Attributes:
        add_generation_prompt: end with the template's assistant header (the model answers).
        continue_final_message: leave the last message open so the model continues it (its
            role must be ``assistant``; excludes ``add_generation_prompt``).
        add_special_tokens: tokenize the rendered text with the tokenizer's own special tokens
            (BOS) on top of the template's.
        template_kwargs: extra variables for the chat template (``{"enable_thinking": false}``).
    """

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelTokenizer:
    """A Hugging Face tokenizer plus what the router needs beside it.

    Attributes:
        hf: the ``transformers`` tokenizer (encode, decode, chat template).
        eos_token_ids: tokens that end generation unless ``ignore_eos`` (tokenizer EOS and
            ``generation_config.json``'s ``eos_token_id``, which may be a list).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_token_chars: the most characters of input text one token can cover (the longest
            vocabulary entry, special tokens included), so a text of ``c`` characters has at least
            ``ceil(c / max_token_chars)`` tokens; 0: no such bound is known (no pre-check).
        chat_template: the template every chat renders with (``--chat-template``); None: the
            model's own, and the bundled tool template (router.chat_templates) for a chat
            involving tools when the model's own has no place for them.
    """

    hf: Any
    eos_token_ids: frozenset[int]
    vocab_size: int
    max_token_chars: int = 0
    chat_template: str | None = None

    def min_num_tokens(self, num_chars: int) -> int:
        """A lower bound on the tokens of a text of ``num_chars`` characters, found without
        tokenizing it (0 when ``max_token_chars`` is unknown)."""
        return -(-num_chars // self.max_token_chars) if self.max_token_chars else 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of a completion prompt, with the tokenizer's own special tokens (BOS)
        unless ``add_special_tokens`` is false."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    @cached_property
    def reserved_template_names(self) -> frozenset[str]:
        """Names ``apply_chat_template`` takes itself, so a template variable cannot have them."""
        names = inspect.signature(self.hf.apply_chat_template).parameters
        return frozenset(n for n, p in names.items() if p.kind is not inspect.Parameter.VAR_KEYWORD) | {"messages"}

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    options: ChatOptions = ChatOptions()) -> list[int]:
        """Token ids of a chat rendered by the chat template (by default ready for the assistant
        turn, see :class:`ChatOptions`).

        ``tools``: OpenAI tool objects the template lists. The template is :attr:`chat_template`
        when set; else the model's own, unless the chat has tools, tool calls or tool results
        and the model's template has no place for them (:func:`renders_tools`): then the
        bundled tool template.

        Raises:
            ValueError: there is no chat template, the template rejected the messages, or a
                template variable takes the name of a render option.
        """
        template = self.chat_template
        with_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if template is None and with_tools and not renders_tools(getattr(self.hf, "chat_template", None)):
            template = bundled_template(TOOL_TEMPLATE)
        if template is None and not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        reserved = sorted(self.reserved_template_names & options.template_kwargs.keys())
        if reserved:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        try:
            text = self.hf.apply_chat_template(
                messages, tools=tools, chat_template=template, add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, tokenize=False, **options.template_kwargs,
            )
        except Exception as err:  # jinja2 TemplateError and friends
            raise ValueError(f"the chat template rejected the messages: {err}") from err
        return self.encode(text, add_special_tokens=options.add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as text for logprobs, special tokens included (``<|im_end|>``); a token that
        holds part of a UTF-8 character renders as U+FFFD (its :meth:`token_bytes` are exact)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for, so the bytes of a text's tokens join into the
        text's UTF-8 even where a token holds part of a character.

        Byte-level BPE (GPT-2, Llama 3, SmolLM) writes each byte as one printable character of
        its vocabulary entry (``bytes_to_unicode``), SentencePiece a space as ``▁`` and a
        byte-fallback byte as ``<0xE3>``; special tokens are their text.
        """
        return self._token_bytes[token_id] if 0 <= token_id < len(self._token_bytes) else b""

    @cached_property
    def _token_bytes(self) -> tuple[bytes, ...]:
        """Every token's bytes by id (built once: ~50 ms for a 50k vocabulary)."""
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # heavy import, kept off module import

        backend = getattr(self.hf, "backend_tokenizer", None)
        byte_level = backend is not None and "ByteLevel" in repr(backend.decoder)
        unicode_to_byte = {c: b for b, c in bytes_to_unicode().items()}
        special = set(self.hf.all_special_tokens) | {str(t) for t in getattr(self.hf, "added_tokens_decoder", {}).values()}
        table = []
        for token in self.hf.convert_ids_to_tokens(list(range(len(self.hf)))):
            if token is None:
                table.append(b"")
            elif token in special:
                table.append(token.encode("utf-8"))
            elif byte_level and all(c in unicode_to_byte for c in token):
                table.append(bytes(unicode_to_byte[c] for c in token))
            elif (match := _BYTE_FALLBACK.fullmatch(token)) is not None:
                table.append(bytes([int(match.group(1), 16)]))
            else:
                table.append(token.replace("\u2581", " ").encode("utf-8"))
        return tuple(table)


def renders_tools(template: str | dict[str, str] | None) -> bool:
    """Whether a model's chat template lists tools: it reads the ``tools`` variable, or it is a
    set of named templates with a ``tool_use`` one (which transformers picks when tools are given)."""
    if isinstance(template, dict):
        return "tool_use" in template or any(renders_tools(t) for t in template.values())
    return bool(template) and re.search(r"\btools\b", template) is not None


# tokenizer_config.json classes that are transformers' PreTrainedTokenizerFast (a tokenizer.json
# run by the tokenizers library): loaded as that class, without AutoTokenizer, which imports torch
# (~3 s and ~300 MB more for a router that runs no model).
FAST_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load_tokenizer(source: ModelSource) -> ModelTokenizer:
    """Loads the tokenizer of ``source``: from its converted Hugging Face folder when it exists
    (~0.7 s for a PreTrainedTokenizerFast, ~4 s through AutoTokenizer otherwise), else straight
    from the GGUF file (~6 s).

    Raises:
        OSError: the tokenizer files cannot be read.
    """
    folder = source.converted_dir
    if folder.is_dir() and _tokenizer_class(folder) in FAST_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast  # heavy import, kept off module import

        hf = PreTrainedTokenizerFast.from_pretrained(folder)
    elif folder.is_dir():
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(folder)
    else:
        from transformers import AutoTokenizer

        log.info("no converted folder at %s; reading the tokenizer from %s", folder, source.path)
        hf = AutoTokenizer.from_pretrained(source.path.parent, gguf_file=source.path.name)
    eos = set() if hf.eos_token_id is None else {int(hf.eos_token_id)}
    config_path = folder / "generation_config.json"
    if config_path.is_file():
        value = json.loads(config_path.read_text()).get("eos_token_id")
        eos.update(int(v) for v in ([] if value is None else value if isinstance(value, list) else [value]))
    return ModelTokenizer(hf=hf, eos_token_ids=frozenset(eos), vocab_size=len(hf), max_token_chars=max_token_chars(hf))


def _tokenizer_class(folder: Path) -> str:
    """The ``tokenizer_class`` of ``folder``'s tokenizer_config.json ("" when it names none)."""
    try:
        return str(json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class") or "")
    except (OSError, ValueError):
        return ""


def max_token_chars(hf: Any) -> int:
    """The most input characters one token of ``hf`` can cover; 0 when no bound holds.

    Byte-level BPE (GPT-2, Llama 3, SmolLM) writes each byte as one character of a vocabulary
    entry, SentencePiece writes a space as one ``▁``: an entry's length bounds the characters it
    covers (an input character is at least one byte). A BPE that fuses unknown characters into one
    token without byte fallback has no bound; an NFC/NFKC normalizer may compose up to 3
    characters (Hangul jamo) into one, so the bound triples.
    """
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer: nothing to inspect
        return 0
    model = backend.model
    if getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False):
        return 0
    longest = max((len(token) for token in hf.get_vocab()), default=0)
    normalizer = repr(backend.normalizer)
    return 3 * longest if "NFC" in normalizer or "NFKC" in normalizer else longest
