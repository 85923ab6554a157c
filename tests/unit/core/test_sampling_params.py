"""SamplingParams refuses every out-of-range value with the field's name and the value quoted."""

from __future__ import annotations

import pytest

from core.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"temperature": -0.1}, "temperature", "temperature must be >= 0, got -0.1"),
        ({"temperature": float("nan")}, "temperature", "temperature must be >= 0, got nan"),
        ({"top_p": 0.0}, "top_p", "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p", "top_p must be in (0, 1], got 1.5"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
        ({"top_k": -2}, "top_k", "top_k must be -1, 0 (disabled) or positive, got -2"),
        ({"seed": 2**64}, "seed", "seed must be in [0, 2**64), got 18446744073709551616"),
        ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be > 0 and finite, got 0.0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty",
         "repetition_penalty must be > 0 and finite, got inf"),
        ({"logprobs": 21}, "logprobs", "logprobs must be in [0, 20], got 21"),
        ({"min_tokens": 9}, "min_tokens", "min_tokens (9) must not exceed max_tokens (8)"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens must be >= 0, got -1"),
    ],
)
def test_out_of_range_values_are_refused_by_name(kwargs: dict, param: str, message: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{"max_tokens": 8, **kwargs})
    assert (info.value.param, str(info.value)) == (param, message)


def test_none_means_the_default_and_numbers_are_normalised() -> None:
    params = SamplingParams.from_optional(temperature=None, top_p=1, seed=None, stop_token_ids=[3, 4], max_tokens=5)
    assert params == SamplingParams(max_tokens=5, stop_token_ids=(3, 4))
    assert type(params.top_p) is float and params.stop_token_ids == (3, 4)
