"""The bundled Hermes tool template renders a conversation with tools, a call and its result to
the exact text below; which template a chat renders with; ``--chat-template`` values."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from router.api.tools import template_message
from router.chat_templates import bundled_template, load_chat_template
from router.tokenizer import ModelTokenizer, renders_tools

TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "9 C"},
]
RENDERED = """<|im_start|>system
Be brief.

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", \
"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
<|im_start|>user
Weather in Paris and Oslo?<|im_end|>
<|im_start|>assistant
Checking.
<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris"}}
</tool_call>
<tool_call>
{"name": "get_weather", "arguments": {"city": "Oslo"}}
</tool_call><|im_end|>
<|im_start|>user
<tool_response>
18 C
</tool_response>
<tool_response>
9 C
</tool_response><|im_end|>
<|im_start|>assistant
"""


def render(tokenizer: ModelTokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    ids = tokenizer.encode_chat([template_message(m) for m in messages], tools)
    return tokenizer.hf.decode(ids)


def test_a_tool_conversation_renders_exactly(tokenizer: ModelTokenizer) -> None:
    text = bundled_template("hermes")
    messages = [template_message(m) for m in CONVERSATION]
    assert tokenizer.hf.apply_chat_template(messages, tools=[TOOL], chat_template=text, tokenize=False,
                                            add_generation_prompt=True) == RENDERED
    # Through the router's tokenizer: the same text, as tokens.
    assert tokenizer.encode_chat(messages, [TOOL]) == tokenizer.hf.encode(RENDERED, add_special_tokens=False)


def test_a_chat_without_tools_keeps_the_models_own_template(tokenizer: ModelTokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert render(tokenizer, messages) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    # Tools, a call or a result anywhere: the tool template (which adds no system prompt of its own).
    assert render(tokenizer, CONVERSATION[1:]).startswith("<|im_start|>user\nWeather in Paris and Oslo?")


def test_a_model_template_that_lists_tools_renders_them_itself(tokenizer: ModelTokenizer) -> None:
    assert not renders_tools(tokenizer.hf.chat_template)  # SmolLM2's: no place for tools
    hf = copy.copy(tokenizer.hf)
    hf.chat_template = ("{% for t in tools %}<{{ t.function.name }}>{% endfor %}"
                        "{% for m in messages %}{{ m.content }}{% endfor %}")
    own = dataclasses.replace(tokenizer, hf=hf)
    assert render(own, [{"role": "user", "content": "hi"}], [TOOL]) == "<get_weather>hi"
    assert not renders_tools(tokenizer.hf.chat_template)  # the shared tokenizer is untouched
    assert renders_tools({"default": "{{ messages }}", "tool_use": "{{ tools }}"})
    assert not renders_tools({"default": "{{ messages }}"}) and not renders_tools(None)


def test_a_configured_template_renders_every_chat(tokenizer: ModelTokenizer, tmp_path) -> None:
    hermes = dataclasses.replace(tokenizer, chat_template=load_chat_template("hermes"))
    assert render(hermes, [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]) == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    plain = dataclasses.replace(tokenizer, chat_template=load_chat_template(str(path)))
    assert render(plain, [{"role": "user", "content": "hi"}], [TOOL]) == "[user] hi\n"


def test_chat_template_values() -> None:
    assert load_chat_template("") is None
    with pytest.raises(FileNotFoundError, match=r"--chat-template 'chatml' is neither a bundled template "
                                                r"\(hermes\) nor a file"):
        load_chat_template("chatml")
    with pytest.raises(ValueError, match="no bundled chat template 'x'; bundled: hermes"):
        bundled_template("x")
