"""core.structured_output: what a spec refuses before any grammar library sees it, with the
message a client reads."""

from __future__ import annotations

import dataclasses

import pytest

from core.sampling_params import SamplingParams, SamplingParamsError
from core.structured_output import StructuredOutputError, StructuredOutputSpec


def test_a_schema_dict_becomes_json_text_and_the_spec_is_hashable() -> None:
    spec = StructuredOutputSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, strict=True)
    assert spec == StructuredOutputSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', True)
    assert hash(spec) == hash(StructuredOutputSpec.json_schema(spec.value, strict=True))


@pytest.mark.parametrize(("kind", "value", "message"), [
    ("xml", "", "kind must be one of json_schema, json_object, regex, choice, grammar, got \"xml\""),
    ("json_schema", "{", "the schema is not valid JSON: Expecting property name enclosed in double quotes: "
                         "line 1 column 2 (char 1)"),
    ("json_schema", "[1]", "the schema must be a JSON object, got list"),
    ("json_schema", '{"type": "integr"}', "the schema is invalid at type: 'integr' is not valid under any of the "
                                          "given schemas"),
    ("json_schema", '{"properties": {"a": {"minimum": "3"}}}',
     "the schema is invalid at properties/a/minimum: '3' is not of type 'number'"),
    ("json_object", "{}", 'a json_object spec has no value, got "{}"'),
    ("regex", "", "the regex is empty"),
    ("regex", "[a-", "the regex is invalid: unterminated character set at position 0"),
    ("choice", "[]", "choices must be a non-empty list of strings"),
    ("choice", '["a", 3]', "choice 1 must be a non-empty string, got 3"),
    ("choice", '["a", ""]', 'choice 1 must be a non-empty string, got ""'),
    ("grammar", "  ", "the grammar is empty"),
])
def test_a_bad_value_is_refused_with_the_reason(kind: str, value: str, message: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        StructuredOutputSpec(kind, value)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_choices_round_trip() -> None:
    assert StructuredOutputSpec.choice(["yes", "no", "ça"]).choices == ["yes", "no", "ça"]
    assert StructuredOutputSpec.choice(["ça"]).value == '["ça"]'


def test_sampling_params_refuse_what_the_grammar_cannot_end() -> None:
    spec = StructuredOutputSpec("json_object")
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs=spec, ignore_eos=True)
    assert (info.value.param, str(info.value)) == (
        "ignore_eos", "ignore_eos cannot be combined with a structured output (the grammar ends the output with EOS)")
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_outputs=spec, min_tokens=2)
    assert info.value.param == "min_tokens"
    with pytest.raises(SamplingParamsError) as info:
        dataclasses.replace(SamplingParams(), structured_outputs='{"type": "object"}')
    assert info.value.param == "structured_outputs"
