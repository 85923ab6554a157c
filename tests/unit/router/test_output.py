"""OutputProcessor: when a request ends, and what text it yields."""

from __future__ import annotations

from core.request import FinishReason
from core.sampling_params import SamplingParams
from router.output import OutputProcessor

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
