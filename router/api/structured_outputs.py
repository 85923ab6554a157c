"""The body fields that ask for a structured output, and the one StructuredOutputSpec they make.

OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with ``schema`` and
``strict``), vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` and its newer ``structured_outputs`` object (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``). At most one of them may ask for a constraint; a bad value is a
400 naming the field that holds it (``response_format.json_schema.schema``, ``guided_regex``,
``structured_outputs.choice``).
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.structured_output import StructuredOutputError, StructuredOutputSpec
from router.api.validation import InvalidRequestError

# A spec from one field's value, by kind; each kind's field in the guided_* form and in vLLM's
# structured_outputs object (whose "json" is the attribute json_).
_SPEC_OF_KIND = {
    "json": StructuredOutputSpec.json_schema,
    "regex": functools.partial(StructuredOutputSpec, "regex"),
    "choice": StructuredOutputSpec.choice,
    "grammar": functools.partial(StructuredOutputSpec, "grammar"),
}
_GUIDED_NAMES = (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                 ("grammar", "guided_grammar"))
_STRUCTURED_NAMES = (("json", "json_"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``."""

    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's ``structured_outputs`` (its StructuredOutputsParams, the fields Tandem takes)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredOutputFields(BaseModel):
    """The fields, mixed into both OpenAI bodies."""

    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsBody | None = None

    def structured_output_spec(self) -> tuple[StructuredOutputSpec | None, str | None]:
        """The request's spec and the param that set it, or ``(None, None)`` for free text.

        Raises:
            InvalidRequestError: two fields ask for a constraint, or one holds a bad value.
        """
        asked = [(param, make) for param, make in self._candidates() if make is not None]
        if len(asked) > 1:
            names = ", ".join(param for param, _ in asked)
            raise InvalidRequestError(f"only one structured output may be requested, got {names}", asked[1][0])
        if not asked:
            return None, None
        param, make = asked[0]
        try:
            return make(), param
        except StructuredOutputError as err:
            raise InvalidRequestError(f"{param}: {err}", param) from None

    def _candidates(self):
        """(param, a maker of its spec or None when the field asks for nothing), each field."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidRequestError('response_format.json_schema is required when type is "json_schema"',
                                          "response_format.json_schema")
            schema = fmt.json_schema.json_schema
            yield "response_format.json_schema.schema", lambda: StructuredOutputSpec.json_schema(
                {} if schema is None else schema, bool(fmt.json_schema.strict))
        elif fmt is not None and fmt.type == "json_object":
            yield "response_format", lambda: StructuredOutputSpec("json_object")
        # vLLM's guided_* fields and its structured_outputs object name the same four kinds.
        body = self.structured_outputs
        for prefix, source, names in (("", self, _GUIDED_NAMES), ("structured_outputs.", body, _STRUCTURED_NAMES)):
            for kind, name in (() if source is None else names):
                value = getattr(source, name)
                if value is not None:
                    yield prefix + name.rstrip("_"), functools.partial(_SPEC_OF_KIND[kind], value)
        if body is not None:
            if body.json_object:
                yield "structured_outputs.json_object", lambda: StructuredOutputSpec("json_object")
