"""OutputProcessor: when a request ends, and what text it yields."""

from __future__ import annotations

import pytest

from core.request import FinishReason, Request, stop_reason, stop_token_ids
from core.sampling_params import SamplingParams
from router.output.processor import OutputProcessor

EOS = 2


def byte_decode(ids: list[int]) -> str:
    return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")


def make(stop=(), **params) -> OutputProcessor:
    return OutputProcessor(SamplingParams(**params), stop, frozenset({EOS}), byte_decode)


def test_eos_ends_and_extra_tokens_are_ignored() -> None:
    out = make(max_tokens=10)
    step = out.add_tokens([ord("h"), ord("i"), EOS, ord("x")])
    assert (step.text, step.token_ids, step.finish_reason) == ("hi", (104, 105, EOS), FinishReason.STOP)
    assert out.add_tokens([ord("y")]).token_ids == ()
    assert out.num_output_tokens == 3


def test_ignore_eos_keeps_going_until_max_tokens() -> None:
    out = make(max_tokens=3, ignore_eos=True)
    assert out.add_tokens([ord("a"), EOS]).finish_reason is None
    step = out.add_tokens([ord("b"), ord("c")])
    assert (step.text, step.token_ids, step.finish_reason) == ("b", (ord("b"),), FinishReason.LENGTH)


def test_stop_token_id_ends_with_stop() -> None:
    out = make(max_tokens=10, stop_token_ids=(ord("!"),))
    assert out.add_tokens(list(b"ok!more")).finish_reason is FinishReason.STOP
    assert out.token_ids == list(b"ok!")


def test_stop_string_truncates_and_reports_stop() -> None:
    out = make(stop=("END",), max_tokens=20)
    assert out.add_tokens(list(b"abc E")).text == "abc "
    step = out.add_tokens(list(b"ND tail"))
    assert (step.text, step.finish_reason, out.stopped_by_string) == ("", FinishReason.STOP, True)


def test_worker_finish_flushes_held_text_once() -> None:
    out = make(stop=("xyz",), max_tokens=20)
    assert out.add_tokens(list(b"ab x")).text == "ab "
    assert out.finish(FinishReason.LENGTH) == "x"
    assert out.finish(FinishReason.STOP) == ""
    assert out.finish_reason is FinishReason.LENGTH


def test_min_tokens_defers_eos_and_stop_tokens() -> None:
    out = make(max_tokens=10, min_tokens=3, stop_token_ids=(ord("!"),))
    step = out.add_tokens([EOS, ord("!"), ord("a"), EOS, ord("b")])
    assert (step.token_ids, step.finish_reason) == ((EOS, ord("!"), ord("a"), EOS), FinishReason.STOP)
    out = make(max_tokens=10, min_tokens=2)
    assert out.add_tokens([ord("a"), EOS]).finish_reason is None  # index 1 < min_tokens


def test_stop_strings_wait_for_min_tokens() -> None:
    out = make(stop=("ab",), max_tokens=20, min_tokens=2)
    assert (out.add_tokens(list(b"ab")).text, out.finish_reason) == ("ab", None)
    step = out.add_tokens(list(b"cab"))
    assert (step.text, step.finish_reason) == ("c", FinishReason.STOP)


@pytest.mark.parametrize("min_tokens", [0, 2])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_engine_and_router_end_a_request_at_the_same_token(min_tokens, ignore_eos):
    """core.request.stop_reason is the one stop rule: the engine's Request and the router's
    OutputProcessor both apply it, so they end the same token stream at the same index."""
    params = SamplingParams(max_tokens=6, min_tokens=min_tokens, stop_token_ids=(9,), ignore_eos=ignore_eos)
    for stream in ([2, 5, 9, 7, 7, 7], [2, 2, 5, 5, 5, 5, 5], [5, 9, 2, 7, 7, 7]):
        engine_side = Request("r", [1], params, eos_token_id=2)
        reasons = [engine_side.append_output_token(t) for t in stream]
        end = next(i for i, r in enumerate(reasons) if r is not None)
        router_side = OutputProcessor(params, (), frozenset({2}), lambda ids: "")
        step = router_side.add_tokens(stream)
        assert (len(step.token_ids), router_side.finish_reason) == (end + 1, reasons[end])
    assert stop_reason(params, frozenset({9}), 9, min_tokens + 1) is FinishReason.STOP
    assert stop_reason(params, frozenset({9}), 9, max(1, min_tokens)) is (None if min_tokens else FinishReason.STOP)
    assert stop_reason(params, frozenset(), 5, 6) is FinishReason.LENGTH
    assert stop_token_ids(params, [2]) == (frozenset({9}) if ignore_eos else frozenset({2, 9}))


def test_a_stop_tokens_text_is_left_out_of_the_output_text() -> None:
    out = make(max_tokens=10, stop_token_ids=(ord("!"),))
    step = out.add_tokens(list(b"ok!more"))
    assert (step.text, step.token_ids, step.finish_reason) == ("ok", tuple(b"ok!"), FinishReason.STOP)
    capped = make(max_tokens=3, stop_token_ids=(ord("!"),))
    assert capped.add_tokens(list(b"abc")).text == "abc"  # the max_tokens-th token's text stays
