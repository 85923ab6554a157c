"""What a structured output must match: a JSON schema, any JSON object, a regex, one of a list of
strings, or an EBNF grammar (``docs/api.md``, structured outputs).

A :class:`StructuredOutputSpec` is plain, hashable data: the router builds it from the request
(``response_format``, vLLM's ``guided_*`` and ``structured_outputs``), it crosses the wire as two
strings (``tandem.v1.StructuredOutput``), and each worker's engine compiles it into a grammar
(cached by ``(kind, value, strict)``) and rebuilds a matcher from the tokens already accepted.
Checked here: what can be checked without the grammar library (the router imports no torch):
the JSON schema parses and is a valid schema (Draft 2020-12 meta-schema), the regex compiles
under Python's ``re`` (its syntax is a superset of what the engine takes for common patterns),
the choices are a non-empty list of non-empty strings. Whatever the grammar library still
refuses is refused by the worker (gRPC ``INVALID_ARGUMENT``, HTTP 400).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """A structured-output spec that cannot be used; the message says why and quotes the value."""


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's output constraint.

    Attributes:
        kind: one of :data:`KINDS`.
        value: by kind: ``json_schema`` the schema as JSON text; ``json_object`` ""; ``regex``
            the pattern; ``choice`` a JSON list of the allowed strings; ``grammar`` EBNF
            (GBNF / xgrammar's dialect, rule ``root`` first).
        strict: ``json_schema`` only: properties and items the schema does not name are refused
            even where the schema leaves them open (OpenAI's ``strict``). Ignored by other kinds.

    Raises:
        StructuredOutputError: an unknown kind, or a value that is not valid for its kind.
    """

    kind: str
    value: str = ""
    strict: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"kind must be one of {', '.join(KINDS)}, got {json.dumps(self.kind)}")
        if not isinstance(self.value, str):
            raise StructuredOutputError(f"value must be a string, got {type(self.value).__name__}")
        check = _CHECKS.get(self.kind)
        if check is not None:
            check(self.value)

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, strict: bool = False) -> StructuredOutputSpec:
        """A ``json_schema`` spec from a schema as a dict or as JSON text.

        Raises:
            StructuredOutputError: the text is not JSON, or the schema is not a valid schema.
        """
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
        return cls("json_schema", text, strict)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputSpec:
        """A ``choice`` spec: the output is exactly one of ``choices``.

        Raises:
            StructuredOutputError: not a non-empty list of non-empty strings.
        """
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise StructuredOutputError("choices must be a list of strings")
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    @property
    def choices(self) -> list[str]:
        """A ``choice`` spec's strings."""
        return json.loads(self.value)


def _check_json_schema(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise StructuredOutputError(f"the schema is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredOutputError(f"the schema must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as err:
        where = "/".join(str(p) for p in err.absolute_path)
        raise StructuredOutputError(f"the schema is invalid{' at ' + where if where else ''}: {err.message}") from None


def _check_json_object(text: str) -> None:
    if text:
        raise StructuredOutputError(f"a json_object spec has no value, got {json.dumps(text)[:60]}")


def _check_regex(text: str) -> None:
    if not text:
        raise StructuredOutputError("the regex is empty")
    try:
        re.compile(text)
    except re.error as err:
        raise StructuredOutputError(f"the regex is invalid: {err}") from None


def _check_choice(text: str) -> None:
    try:
        choices = json.loads(text)
    except json.JSONDecodeError as err:
        raise StructuredOutputError(f"the choices are not a JSON list: {err}") from None
    if not isinstance(choices, list) or not choices:
        raise StructuredOutputError("choices must be a non-empty list of strings")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise StructuredOutputError(f"choice {i} must be a non-empty string, got {json.dumps(choice)[:60]}")


def _check_grammar(text: str) -> None:
    if not text.strip():
        raise StructuredOutputError("the grammar is empty")


_CHECKS = {
    "json_schema": _check_json_schema,
    "json_object": _check_json_object,
    "regex": _check_regex,
    "choice": _check_choice,
    "grammar": _check_grammar,
}
