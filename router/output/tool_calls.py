"""Tool calls read out of generated text, whole or piece by piece as it streams.

Three formats, one parser each (:func:`make_parser` picks it from a :class:`ToolCallFormat`):

- ``hermes``: the model writes calls as Hermes-style blocks (the bundled tool template asks it
  to), anywhere in its text; what lies outside the blocks is content::

      Let me look that up.<tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  A block whose JSON does not parse, or lacks a string ``name`` or an object ``arguments``, is
  not a call: its text (tags included) stays in the content. The last block may be left
  unclosed (generation ended on EOS right after its JSON). Text after a call that is only
  whitespace is dropped.
- ``named``: the whole text is the arguments of one call to a known function (``tool_choice``
  naming a function; the grammar makes the text a JSON object of the function's parameters).
- ``json``: the whole text is a JSON array of ``{"name": ..., "arguments": {...}}`` objects, or
  one such object (``tool_choice: "required"``; the grammar makes it so). Anything left
  unparsed when the text ends (a generation cut by ``max_tokens``) becomes content.

Streaming follows OpenAI's ``delta.tool_calls``: each call is announced by a delta carrying its
``index``, ``id``, ``type`` and ``function.name`` (arguments ``""``), then its arguments come in
one or more deltas of the same ``index`` that concatenate to the arguments' JSON text. A Hermes
or ``json`` call is announced once its JSON is complete (so a malformed block can still fall
back to content); a ``named`` call streams its arguments as they are generated.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FORMATS = ("hermes", "named", "json")


def new_tool_call_id() -> str:
    """A fresh call id: ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCallFormat:
    """How one request's output holds its tool calls: ``kind`` is one of :data:`FORMATS`;
    ``function_name`` is the called function of a ``named`` format."""

    kind: str
    function_name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FORMATS:
            raise ValueError(f"tool call format must be one of {FORMATS}, got {self.kind!r}")
        if (self.kind == "named") != (self.function_name is not None):
            raise ValueError("a named tool call format needs function_name, and only it")


@dataclass(frozen=True)
class ToolCall:
    """A complete call; ``arguments`` is JSON text (OpenAI sends it as a string)."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of call ``index``: the announcement (``id`` and ``name`` set, no arguments) or
    a piece of its arguments' text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedDelta:
    """What a piece of generated text turned into: content to send, and call pieces."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()


class ToolCallParser:
    """Base of the parsers: :meth:`feed` the text as it arrives, then :meth:`finish` once.
    :attr:`calls` holds every call announced so far, with the arguments received."""

    def __init__(self) -> None:
        self._ids: list[str] = []
        self._names: list[str] = []
        self._arguments: list[list[str]] = []

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(i, n, "".join(a)) for i, n, a in zip(self._ids, self._names, self._arguments)]

    def feed(self, text: str) -> ParsedDelta:
        """Takes the next piece of generated text; returns what can be sent for it now."""
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        """The text has ended: returns what was held back."""
        raise NotImplementedError

    def _announce(self, name: str) -> ToolCallDelta:
        self._ids.append(new_tool_call_id())
        self._names.append(name)
        self._arguments.append([])
        return ToolCallDelta(len(self._ids) - 1, self._ids[-1], name)

    def _arguments_piece(self, text: str) -> ToolCallDelta:
        self._arguments[-1].append(text)
        return ToolCallDelta(len(self._ids) - 1, arguments=text)

    def _whole_call(self, name: str, arguments: str) -> tuple[ToolCallDelta, ...]:
        return (self._announce(name), self._arguments_piece(arguments))


def _call_of(value: Any) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a decoded ``{"name": ..., "arguments": {...}}``, or
    None when ``value`` is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag`` (held back until the next
    piece says whether they do)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class HermesParser(ToolCallParser):
    """``<tool_call>`` blocks anywhere in the text (the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = ""  # text not yet sent: a possible start tag, or a block's body so far
        self._in_block = False
        self._searched = 0  # in a block: where in self._buffer the end tag may still start
        self._whitespace = ""  # whitespace after a call, sent only if content follows it

    def feed(self, text: str) -> ParsedDelta:
        self._buffer += text
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        while True:
            if self._in_block:
                end = self._buffer.find(TOOL_CALL_END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._buffer) - len(TOOL_CALL_END) + 1)
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(TOOL_CALL_END):]
                self._in_block = False
                self._close_block(body, TOOL_CALL_END, content, calls)
                continue
            start = self._buffer.find(TOOL_CALL_START)
            if start < 0:
                keep = _held_prefix(self._buffer, TOOL_CALL_START)
                self._content(self._buffer[:len(self._buffer) - keep], content)
                self._buffer = self._buffer[len(self._buffer) - keep:]
                break
            self._content(self._buffer[:start], content)
            self._buffer = self._buffer[start + len(TOOL_CALL_START):]
            self._in_block, self._searched = True, 0
        return ParsedDelta("".join(content), tuple(calls))

    def finish(self) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        if self._in_block:
            self._close_block(self._buffer, "", content, calls)
        else:
            self._content(self._buffer, content)
        self._buffer, self._in_block = "", False
        return ParsedDelta("".join(content), tuple(calls))

    def _close_block(self, body: str, end_tag: str, content: list[str], calls: list[ToolCallDelta]) -> None:
        try:
            call = _call_of(json.loads(body))
        except ValueError:
            call = None
        if call is None:
            self._content(TOOL_CALL_START + body + end_tag, content)
            return
        self._whitespace = ""
        calls.extend(self._whole_call(*call))

    def _content(self, text: str, out: list[str]) -> None:
        """Appends ``text`` to ``out``; after a call, whitespace waits for content to follow it."""
        if not self._ids:
            out.append(text)
            return
        text = self._whitespace + text
        stripped = text.rstrip()
        self._whitespace = text[len(stripped):]
        out.append(stripped)


class NamedFunctionParser(ToolCallParser):
    """The whole text is the arguments of a call to ``function_name``."""

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def feed(self, text: str) -> ParsedDelta:
        pieces = [] if self._ids else [self._announce(self.function_name)]
        if text:
            pieces.append(self._arguments_piece(text))
        return ParsedDelta("", tuple(pieces))

    def finish(self) -> ParsedDelta:
        return self.feed("")


class JsonCallsParser(ToolCallParser):
    """The whole text is a JSON array of calls, or one call object. Each object is decoded
    once its closing brace arrives: the scanner tracks only string and nesting state. An object
    that is no call is content, sent with the next call or at the end."""

    def __init__(self) -> None:
        super().__init__()
        self._chars: list[str] = []  # the text since the end of the last decoded call
        self._depth = 0  # [ and { open
        self._object_depth = 0  # the depth at which call objects sit: 1 inside an array, 0 alone
        self._started = False  # the first bracket was seen
        self._in_string = False
        self._escaped = False
        self._object_start = -1  # index in self._chars of the object being read
        self._unparsed_start = -1  # index in self._chars of the first object not decoded as a call

    def feed(self, text: str) -> ParsedDelta:
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        for char in text:
            self._chars.append(char)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "[{":
                if not self._started:
                    self._started = True
                    self._object_depth = 1 if char == "[" else 0
                if char == "{" and self._depth == self._object_depth:
                    self._object_start = len(self._chars) - 1
                    if self._unparsed_start < 0:
                        self._unparsed_start = self._object_start
                self._depth += 1
            elif char in "]}":
                self._depth -= 1
                if char == "}" and self._depth == self._object_depth and self._object_start >= 0:
                    self._decode(content, calls)
        return ParsedDelta("".join(content), tuple(calls))

    def finish(self) -> ParsedDelta:
        """What was never decoded (an unfinished object, or objects that are no call) is content."""
        rest = "".join(self._chars[self._unparsed_start:]) if self._unparsed_start >= 0 else ""
        self._chars, self._object_start, self._unparsed_start = [], -1, -1
        return ParsedDelta(rest.strip(), ())

    def _decode(self, content: list[str], calls: list[ToolCallDelta]) -> None:
        try:
            call = _call_of(json.loads("".join(self._chars[self._object_start:])))
        except ValueError:
            call = None
        if call is not None:
            if self._unparsed_start < self._object_start:  # objects before it that were no call
                content.append("".join(self._chars[self._unparsed_start:self._object_start]).strip())
            calls.extend(self._whole_call(*call))
            self._chars, self._unparsed_start = [], -1
        self._object_start = -1


def make_parser(fmt: ToolCallFormat) -> ToolCallParser:
    if fmt.kind == "hermes":
        return HermesParser()
    if fmt.kind == "named":
        return NamedFunctionParser(fmt.function_name or "")
    return JsonCallsParser()


def parse_tool_calls(fmt: ToolCallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole generated ``text``."""
    parser = make_parser(fmt)
    first, last = parser.feed(text), parser.finish()
    return first.content + last.content, parser.calls
