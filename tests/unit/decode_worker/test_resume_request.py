"""The decode worker's checks of a resumed request (``DecodeRequest.output_token_ids``)."""

from __future__ import annotations

import pytest

from core.request import FinishReason
from decode_worker.servicer import _append_outputs
from tests.factories import make_request


def test_resumed_outputs_count_toward_max_tokens():
    request = make_request(5, max_tokens=4)
    _append_outputs(request, [10, 11, 12])
    assert request.output_token_ids == [10, 11, 12] and not request.is_finished


def test_outputs_ending_exactly_at_max_tokens_finish_the_request():
    request = make_request(5, max_tokens=2)
    _append_outputs(request, [10, 11])
    assert request.finish_reason is FinishReason.LENGTH  # the servicer answers Finished at once


@pytest.mark.parametrize(("max_tokens", "outputs", "reason"), [
    (2, [10, 11, 12], "length"),  # one token past max_tokens
    (8, [10, 2, 12], "stop"),  # a token after EOS
])
def test_outputs_running_past_the_end_are_refused(max_tokens, outputs, reason):
    with pytest.raises(ValueError) as info:
        _append_outputs(make_request(5, max_tokens=max_tokens), outputs)
    assert str(info.value) == f"output_token_ids end the request at index 1 of 3 ({reason})"
