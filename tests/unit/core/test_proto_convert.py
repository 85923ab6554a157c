"""core.proto_convert's SamplingParams conversion: derived from the dataclass field by field, so
the dataclass and the wire message ``tandem.v1.SamplingParams`` must declare the same fields."""

from __future__ import annotations

import dataclasses

import pytest

from core.proto_convert import sampling_fields_from_proto, sampling_params_from_proto, sampling_params_to_proto
from core.sampling_params import SAMPLING_FIELDS, SamplingParams, SamplingParamsError
from core.structured_output import StructuredOutputError, StructuredOutputSpec
from tandem.v1 import common_pb2

WIRE = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name
DEFAULTS = SamplingParams()
# Every field away from its default; floats that float32 holds exactly (the wire's float).
SET = SamplingParams(temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=2**64 - 1, max_tokens=9, min_tokens=2,
                     stop_token_ids=(5, 6), ignore_eos=True, logprobs=3, prompt_logprobs=2, presence_penalty=0.25,
                     frequency_penalty=-0.5, repetition_penalty=1.5)
# A structured output refuses ignore_eos and min_tokens: the fields SET cannot carry.
STRUCTURED = dataclasses.replace(SET, ignore_eos=False, min_tokens=0,
                                 structured_outputs=StructuredOutputSpec.json_schema({"type": "integer"}, strict=True))


def test_the_dataclass_and_the_wire_message_declare_the_same_fields() -> None:
    assert sorted(SAMPLING_FIELDS) == sorted(WIRE)


@pytest.mark.parametrize("name", SAMPLING_FIELDS)
def test_an_unset_wire_field_means_the_dataclass_default(name: str) -> None:
    """A wire field without presence reads as its zero value when unset: that must be the
    dataclass default, else the field must be ``optional`` in common.proto (or repeated for a
    tuple)."""
    default = getattr(DEFAULTS, name)
    zero = getattr(common_pb2.SamplingParams(), name)
    if WIRE[name].message_type is not None:
        assert (WIRE[name].has_presence, default) == (True, None)  # a message: unset means None
    elif isinstance(default, tuple):
        assert (WIRE[name].has_presence, tuple(zero)) == (False, default)  # repeated, empty
    elif not WIRE[name].has_presence:
        assert zero == default, f"{name}: unset on the wire reads {zero!r}, the default is {default!r}: make it optional"


def test_round_trip_of_every_field() -> None:
    assert all(getattr(SET, f.name) != getattr(DEFAULTS, f.name) or getattr(STRUCTURED, f.name) != getattr(DEFAULTS, f.name)
               for f in dataclasses.fields(SamplingParams))
    assert sampling_params_from_proto(sampling_params_to_proto(SET)) == SET
    assert sampling_params_from_proto(sampling_params_to_proto(STRUCTURED)) == STRUCTURED
    assert sampling_params_from_proto(sampling_params_to_proto(DEFAULTS)) == DEFAULTS


def test_unset_fields_take_the_defaults_and_temperature_is_greedy_on_the_wire() -> None:
    empty = common_pb2.SamplingParams()
    assert sampling_params_from_proto(empty) == SamplingParams(temperature=0.0)
    fields = sampling_fields_from_proto(empty)
    assert (fields["temperature"], fields["max_tokens"], fields["seed"], fields["stop_token_ids"]) == (0.0, None, None, ())
    assert not sampling_params_to_proto(DEFAULTS).HasField("seed")


def test_a_bad_wire_value_names_its_field() -> None:
    with pytest.raises(SamplingParamsError) as info:
        sampling_params_from_proto(common_pb2.SamplingParams(top_p=1.5))
    assert (info.value.param, str(info.value)) == ("top_p", "top_p must be in (0, 1], got 1.5")
    assert isinstance(info.value, ValueError)  # the servicers answer INVALID_ARGUMENT


def test_a_bad_structured_output_on_the_wire_is_a_value_error() -> None:
    msg = common_pb2.SamplingParams(structured_outputs=common_pb2.StructuredOutput(kind="json_schema", value="{"))
    with pytest.raises(StructuredOutputError, match="^the schema is not valid JSON: Expecting property name"):
        sampling_params_from_proto(msg)
