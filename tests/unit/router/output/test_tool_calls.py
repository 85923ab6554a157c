"""Tool calls out of generated text: whole, and streamed in every possible split."""

from __future__ import annotations

import re

import pytest

from router.output.tool_calls import (
    ParsedDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    make_parser,
    parse_tool_calls,
)

HERMES = ToolCallFormat("hermes")
JSON = ToolCallFormat("json")
NAMED = ToolCallFormat("named", "get_weather")
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
WEATHER_ARGS = '{"city": "Paris", "unit": "celsius"}'


def calls_without_ids(calls: list[ToolCall]) -> list[tuple[str, str]]:
    assert all(CALL_ID.match(c.id) for c in calls)
    assert len({c.id for c in calls}) == len(calls)
    return [(c.name, c.arguments) for c in calls]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("The weather is nice.", "The weather is nice.", []),
        (WEATHER, "", [("get_weather", WEATHER_ARGS)]),
        ("Let me check.\n" + WEATHER, "Let me check.\n", [("get_weather", WEATHER_ARGS)]),
        (WEATHER + "\n" + WEATHER.replace("Paris", "Rome") + "\n",
         "", [("get_weather", WEATHER_ARGS), ("get_weather", WEATHER_ARGS.replace("Paris", "Rome"))]),
        (WEATHER + "\nDone.", "\nDone.", [("get_weather", WEATHER_ARGS)]),
        # Unclosed last block (EOS right after the JSON): still a call.
        ('<tool_call>\n{"name": "f", "arguments": {}}\n', "", [("f", "{}")]),
        # No arguments: an empty object.
        ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),
        # Non-ASCII arguments stay as they are.
        ('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>', "", [("f", '{"city": "Zürich"}')]),
        # Malformed JSON, a missing name, arguments that are no object: content, tags included.
        ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>',
         '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
        ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',
         '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', []),
        ("<tool_call>{\"name\": \"f\", \"argu", "<tool_call>{\"name\": \"f\", \"argu", []),
        # Something that only looks like the start tag.
        ("a <tool_ca b <tool>", "a <tool_ca b <tool>", []),
    ],
)
def test_hermes_blocks(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_tool_calls(HERMES, text)
    assert (got_content, calls_without_ids(got_calls)) == (content, calls)


def stream(fmt: ToolCallFormat, pieces: list[str]) -> tuple[str, list[ToolCallDelta]]:
    parser = make_parser(fmt)
    outs = [parser.feed(p) for p in pieces] + [parser.finish()]
    return "".join(o.content for o in outs), [d for o in outs for d in o.tool_calls]


def assemble(deltas: list[ToolCallDelta]) -> list[tuple[str, str]]:
    """What a client builds from the deltas, checking that each call is announced first."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        if delta.id is not None:
            assert delta.index == len(calls) and delta.arguments == "" and CALL_ID.match(delta.id)
            calls[delta.index] = [delta.name, ""]
        else:
            calls[delta.index][1] += delta.arguments
    return [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("fmt_text", [
    (HERMES, "Sure.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo")),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call> and <tool_'),
    (JSON, '[{"name": "get_weather", "arguments": {"city": "a \\"}\\" b"}}, {"name": "g", "arguments": {}}]'),
    (NAMED, WEATHER_ARGS),
], ids=["hermes", "hermes-malformed", "json", "named"])
def test_every_split_streams_what_the_whole_text_parses_to(fmt_text) -> None:
    fmt, text = fmt_text
    content, calls = parse_tool_calls(fmt, text)
    for cut in range(len(text) + 1):  # two pieces, cut anywhere
        got_content, deltas = stream(fmt, [text[:cut], text[cut:]])
        assert (got_content, assemble(deltas)) == (content, calls_without_ids(calls))
    got_content, deltas = stream(fmt, list(text))  # one character at a time
    assert (got_content, assemble(deltas)) == (content, calls_without_ids(calls))


def test_hermes_content_streams_before_the_call_and_holds_only_a_possible_tag() -> None:
    parser = make_parser(HERMES)
    assert parser.feed("Let me check <tool") == ParsedDelta("Let me check ")
    assert parser.feed("box> now <tool_c") == ParsedDelta("<toolbox> now ")
    assert parser.feed('all>{"name": "f", "arguments": {"a": 1}}') == ParsedDelta("")
    out = parser.feed("</tool_call>")
    assert out.content == "" and [d.to_openai() for d in out.tool_calls] == [
        {"index": 0, "id": parser.calls[0].id, "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"a": 1}'}},
    ]
    assert parser.feed("\n\n") == ParsedDelta("")  # whitespace after a call waits ...
    assert parser.feed("ok") == ParsedDelta("\n\nok")  # ... for content
    assert parser.finish() == ParsedDelta("")


def test_named_function_streams_arguments_as_generated() -> None:
    parser = make_parser(NAMED)
    first = parser.feed('{"city"')
    assert [d.to_openai() for d in first.tool_calls] == [
        {"index": 0, "id": parser.calls[0].id, "type": "function",
         "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city"'}},
    ]
    assert parser.feed(': "Paris"}') == ParsedDelta("", (ToolCallDelta(0, arguments=': "Paris"}'),))
    assert parser.finish() == ParsedDelta("")
    assert [c.to_openai()["function"] for c in parser.calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ('[{"name": "f", "arguments": {"x": [1, {"y": "}"}]}}]', "", [("f", '{"x": [1, {"y": "}"}]}')]),
        ('{"name": "f", "arguments": {}}', "", [("f", "{}")]),
        ('[ {"name":"f","arguments":{"a":1}} ,\n {"name":"g","arguments":{}} ]', "",
         [("f", '{"a": 1}'), ("g", "{}")]),
        # Cut by max_tokens: the unfinished object is content.
        ('[{"name": "f", "arguments": {}}, {"name": "g", "argum', '{"name": "g", "argum', [("f", "{}")]),
        ('[{"nam', '{"nam', []),
        # An object that is no call is content, in order with the calls around it.
        ('[{"x": 1}, {"name": "f", "arguments": {}}]', '{"x": 1},', [("f", "{}")]),
    ],
)
def test_json_calls(text: str, content: str, calls: list[tuple[str, str]]) -> None:
    got_content, got_calls = parse_tool_calls(JSON, text)
    assert (got_content, calls_without_ids(got_calls)) == (content, calls)


def test_a_named_format_needs_its_function() -> None:
    with pytest.raises(ValueError, match="needs function_name"):
        ToolCallFormat("named")
    with pytest.raises(ValueError, match="must be one of"):
        ToolCallFormat("mistral")
