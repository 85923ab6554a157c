"""Tool calling on the chat API: the tools a request offers, what its ``tool_choice`` asks, and
what that means for the prompt, the grammar and how the output is read (``docs/api.md``, tool
calls).

===============  ==================  ===============================  ============================
``tool_choice``  tools in prompt     grammar                          output read as
===============  ==================  ===============================  ============================
``"none"``       no                  none                             content only
``"auto"``       yes                 none (the model may or may not   ``<tool_call>`` blocks
                                     call)                            (``--tool-call-parser``)
``"required"``   yes                 a JSON array of one or more      the array's calls
                                     calls (one call with
                                     ``parallel_tool_calls: false``)
named function   yes                 the function's ``parameters``    one call to that function
===============  ==================  ===============================  ============================

``tool_choice`` defaults to ``"auto"`` when tools are given, as OpenAI's; ``"none"`` and
``"auto"`` without tools are accepted and mean no tools; ``"required"`` or a named function
without tools is a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from core.structured_output import StructuredOutputError, StructuredOutputSpec
from router.errors import as_json
from router.output.tool_calls import ToolCallFormat

TOOL_CHOICES = ("none", "auto", "required")
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule
EMPTY_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}  # a function without parameters


class ToolRequestError(ValueError):
    """A tool field of the request is wrong; ``param`` names it (the API answers a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools, checked.

    Attributes:
        tools: OpenAI tool objects, ``{"type": "function", "function": {"name", "description"
            (optional), "parameters"}}``, ``parameters`` filled in (:data:`EMPTY_PARAMETERS`)
            where the client left it out.
        tool_choice: ``none``, ``auto``, ``required``, or ``function`` for a named function.
        function_name: the named function (``tool_choice`` ``function`` only).
        parallel_tool_calls: ``required`` may produce several calls.
    """

    tools: tuple[dict[str, Any], ...]
    tool_choice: str
    function_name: str | None = None
    parallel_tool_calls: bool = True

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template lists, None when they are not offered."""
        return None if self.tool_choice == "none" else list(self.tools)

    def output_format(self, parser: str) -> ToolCallFormat | None:
        """How the output holds its calls; ``parser`` reads them under ``auto``."""
        if self.tool_choice == "none":
            return None
        if self.tool_choice == "auto":
            return ToolCallFormat(parser)
        if self.tool_choice == "required":
            return ToolCallFormat("json")
        return ToolCallFormat("named", self.function_name)

    def structured_output(self) -> StructuredOutputSpec | None:
        """The grammar of ``required`` and of a named function; None for ``none`` and ``auto``.

        Always strict: the arguments hold only the properties the parameters name, unless a
        schema allows others itself (``additionalProperties``); a small model otherwise copies
        schema keywords (``"maxLength": 40``) into its arguments.
        """
        if self.tool_choice in ("none", "auto"):
            return None
        if self.tool_choice == "function":
            function = next(t["function"] for t in self.tools if t["function"]["name"] == self.function_name)
            return StructuredOutputSpec.json_schema(function["parameters"], strict=True)
        return StructuredOutputSpec.json_schema(self.calls_schema(), strict=True)

    @property
    def grammar_param(self) -> str:
        """The field a refusal of :meth:`structured_output` names (the grammar library may
        refuse a schema the JSON-schema check let pass)."""
        if self.tool_choice == "function":
            names = [t["function"]["name"] for t in self.tools]
            return f"tools.{names.index(self.function_name)}.function.parameters"
        return "tools"

    def calls_schema(self) -> dict[str, Any]:
        """The JSON schema of ``required``'s output: ``[{"name": <a tool>, "arguments": {...}},
        ...]`` (one object without parallel calls). Each tool's parameters sit under the root's
        ``$defs`` so that their own ``$ref``s keep pointing where they did (:func:`_hoisted`)."""
        defs: dict[str, Any] = {}
        calls = []
        for tool in self.tools:
            name, parameters = tool["function"]["name"], tool["function"]["parameters"]
            calls.append({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": _hoisted(name, parameters, defs)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            })
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        schema = {"type": "array", "items": call, "minItems": 1} if self.parallel_tool_calls else call
        return {**schema, "$defs": defs} if defs else schema


def _hoisted(name: str, parameters: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """``parameters`` ready to sit inside another schema: as it is when it holds no ``$ref``;
    else moved into ``defs`` as ``<name>.parameters`` (its own ``$defs`` / ``definitions`` as
    ``<name>.<def>``) with every ``$ref`` rewritten to match, and a ``$ref`` to it returned."""
    if '"$ref"' not in json.dumps(parameters):
        return parameters
    prefix = f"#/$defs/{name}."

    def rewrite(node: Any) -> Any:
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions")}
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            pointer = ref[1:]
            for key in ("/$defs/", "/definitions/"):
                if pointer.startswith(key):
                    out["$ref"] = prefix + pointer[len(key):]
                    break
            else:
                out["$ref"] = prefix + "parameters" + pointer
        return out

    for key in ("$defs", "definitions"):
        for def_name, schema in (parameters.get(key) or {}).items():
            defs[f"{name}.{def_name}"] = rewrite(schema)
    defs[f"{name}.parameters"] = rewrite(parameters)
    return {"$ref": prefix + "parameters"}


def tool_request(
    tools: Sequence[dict[str, Any]] | None, tool_choice: str | dict[str, Any] | None, parallel_tool_calls: bool | None
) -> ToolRequest | None:
    """The request's tools, checked; None when it offers none (no tools, ``tool_choice`` absent,
    ``"none"`` or ``"auto"``).

    ``tools``: OpenAI tool objects whose shape the body already checked; ``tool_choice``: a
    string, or ``{"type": "function", "function": {"name": ...}}``.

    Raises:
        ToolRequestError: an unknown ``tool_choice``; ``"required"`` or a named function
            without tools, or a name not among the tools; a function name that is not 1-64
            letters, digits, ``_`` or ``-``, or repeated; ``parameters`` that are not a valid
            JSON schema of an object.
    """
    if isinstance(tool_choice, str) and tool_choice not in TOOL_CHOICES:
        raise ToolRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {as_json(tool_choice)}", "tool_choice")
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    if not tools:
        if tool_choice in (None, "none", "auto"):
            return None
        raise ToolRequestError(f"tool_choice {as_json(tool_choice)} needs tools, and the request has none",
                                  "tool_choice")
    checked = tuple(_checked_tool(tool, i) for i, tool in enumerate(tools))
    names = [t["function"]["name"] for t in checked]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise ToolRequestError(f"tools.{i}.function.name {as_json(name)} is already the name of "
                                      f"tools.{names.index(name)}", f"tools.{i}.function.name")
    if named is not None and named not in names:
        raise ToolRequestError(
            f"tool_choice names function {as_json(named)}, which is not among the tools "
            f"({', '.join(as_json(n) for n in names)})", "tool_choice.function.name")
    choice = "function" if named is not None else (tool_choice or "auto")
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return ToolRequest(checked, choice, named, parallel)


def _checked_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool["function"]
    name = function["name"]
    if not _FUNCTION_NAME.match(name):
        raise ToolRequestError(f"tools.{index}.function.name must be 1 to 64 letters, digits, underscores or "
                                  f"dashes, got {as_json(name)}", f"tools.{index}.function.name")
    param = f"tools.{index}.function.parameters"
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)
    try:
        StructuredOutputSpec.json_schema(parameters)
    except StructuredOutputError as err:
        raise ToolRequestError(f"{param} is not a valid JSON schema: {err}", param) from None
    if parameters.get("type", "object") != "object":
        raise ToolRequestError(f'{param} must describe an object ("type": "object"), '
                                  f"got {as_json(parameters['type'])}", param)
    return {"type": "function", "function": {**function, "parameters": parameters}}


def check_tool_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """Checks the tool turns of a conversation: ``tool_calls`` only on assistant messages, with
    arguments that are a JSON object as text; each ``tool`` message's ``tool_call_id`` answers
    a call of an earlier assistant message.

    Raises:
        ToolRequestError: the first problem, naming the message's field.
    """
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        role, calls, call_id = message["role"], message.get("tool_calls"), message.get("tool_call_id")
        if calls and role != "assistant":
            raise ToolRequestError(f'messages.{i}.tool_calls is only allowed on an "assistant" message, '
                                      f"got role {as_json(role)}", f"messages.{i}.tool_calls")
        if call_id is not None and role != "tool":
            raise ToolRequestError(f'messages.{i}.tool_call_id is only allowed on a "tool" message, '
                                      f"got role {as_json(role)}", f"messages.{i}.tool_call_id")
        for j, call in enumerate(calls or ()):
            _decoded_arguments(call["function"]["arguments"], f"messages.{i}.tool_calls.{j}.function.arguments")
            call_ids.add(call["id"])
        if role == "tool":
            param = f"messages.{i}.tool_call_id"
            if call_id is None:
                raise ToolRequestError(f'{param} is required on a "tool" message', param)
            if call_id not in call_ids:
                raise ToolRequestError(f"{param} {as_json(call_id)} matches no tool call of an earlier "
                                          "assistant message", param)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A checked message as chat templates take it: ``developer`` as ``system``, each tool
    call's arguments decoded into an object (templates write them with ``tojson``)."""
    role = "system" if message["role"] == "developer" else message["role"]
    out = {**message, "role": role}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**call, "function": {**call["function"], "arguments": json.loads(call["function"]["arguments"])}}
            for call in message["tool_calls"]
        ]
    return out


def _decoded_arguments(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        short = text if len(text) <= 60 else text[:57] + "..."
        raise ToolRequestError(f"{param} must be a JSON object as text, got {as_json(short)}", param)
    return value
