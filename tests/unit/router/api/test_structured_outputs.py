"""The body fields that ask for a structured output: each makes its StructuredOutputSpec, a bad
value is refused naming the field that holds it, two at once are refused."""

from __future__ import annotations

import pytest

from core.structured_output import StructuredOutputSpec
from router.api.openai_requests import ChatCompletionRequest, CompletionRequest
from router.api.validation import InvalidRequestError

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'


@pytest.mark.parametrize(("fields", "spec", "param"), [
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputSpec("json_object"), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     StructuredOutputSpec("json_schema", SCHEMA_TEXT, True), "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
     StructuredOutputSpec("json_schema", SCHEMA_TEXT, False), "response_format.json_schema.schema"),
    ({"guided_json": SCHEMA}, StructuredOutputSpec("json_schema", SCHEMA_TEXT), "guided_json"),
    ({"guided_json": SCHEMA_TEXT}, StructuredOutputSpec("json_schema", SCHEMA_TEXT), "guided_json"),
    ({"guided_regex": "[0-9]+"}, StructuredOutputSpec("regex", "[0-9]+"), "guided_regex"),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputSpec("choice", '["yes", "no"]'), "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, StructuredOutputSpec("grammar", 'root ::= "a"'), "guided_grammar"),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputSpec("json_schema", SCHEMA_TEXT), "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a+"}}, StructuredOutputSpec("regex", "a+"), "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["x"]}}, StructuredOutputSpec("choice", '["x"]'), "structured_outputs.choice"),
    ({"structured_outputs": {"grammar": 'root ::= "b"'}}, StructuredOutputSpec("grammar", 'root ::= "b"'),
     "structured_outputs.grammar"),
    ({"structured_outputs": {"json_object": True}}, StructuredOutputSpec("json_object"), "structured_outputs.json_object"),
])
@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_each_field_makes_its_spec_and_it_reaches_the_params(model, fields: dict, spec, param) -> None:
    base = {"prompt": "x"} if model is CompletionRequest else {"messages": [{"role": "user", "content": "x"}]}
    request = model.model_validate({**base, **fields}).to_inputs()[0]
    assert (request.sampling["structured_outputs"], request.structured_param) == (spec, param)
    assert request.to_sampling_params(16).structured_outputs == spec


@pytest.mark.parametrize(("fields", "message", "param"), [
    ({"response_format": {"type": "json_schema"}}, 'response_format.json_schema is required when type is "json_schema"',
     "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integr"}}}},
     "response_format.json_schema.schema: the schema is invalid at type: 'integr' is not valid under any of the "
     "given schemas", "response_format.json_schema.schema"),
    ({"guided_json": "{"}, "guided_json: the schema is not valid JSON: Expecting property name enclosed in double "
                           "quotes: line 1 column 2 (char 1)", "guided_json"),
    ({"guided_json": {"minimum": "3"}}, "guided_json: the schema is invalid at minimum: '3' is not of type 'number'",
     "guided_json"),
    ({"guided_regex": "(a"}, "guided_regex: the regex is invalid: missing ), unterminated subpattern at position 0",
     "guided_regex"),
    ({"guided_choice": []}, "guided_choice: choices must be a non-empty list of strings", "guided_choice"),
    ({"structured_outputs": {"choice": ["a", ""]}}, 'structured_outputs.choice: choice 1 must be a non-empty string, '
                                                    'got ""', "structured_outputs.choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}},
     "only one structured output may be requested, got response_format, guided_regex", "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "only one structured output may be requested, got structured_outputs.regex, structured_outputs.choice",
     "structured_outputs.choice"),
])
def test_a_bad_structured_output_is_a_400_naming_its_field(fields: dict, message: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate({"prompt": "x", **fields}).to_inputs()[0]
    assert (info.value.message, info.value.param, info.value.http_status) == (message, param, 400)


def test_a_structured_output_refuses_ignore_eos_naming_it() -> None:
    request = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "a", "ignore_eos": True}).to_inputs()[0]
    with pytest.raises(ValueError, match="^ignore_eos cannot be combined with a structured output"):
        request.to_sampling_params(16)
