"""Stop strings: truncation before the first match, and no partial stop string ever sent."""

from __future__ import annotations

import pytest

from router.output.stop_strings import StopStringMatcher


def feed_all(stop: list[str], deltas: list[str]) -> tuple[list[str], bool]:
    matcher = StopStringMatcher(stop)
    out = [matcher.feed(d) for d in deltas]
    return out + [matcher.flush()], matcher.stopped


def test_stop_string_split_across_deltas_is_never_partially_sent() -> None:
    out, stopped = feed_all(["STOP"], ["Hello ST", "O", "P world"])
    assert out == ["Hello ", "", "", ""]
    assert stopped


def test_false_start_is_released_once_decided() -> None:
    out, stopped = feed_all(["abd"], ["xab", "c", "d"])
    assert out == ["x", "abc", "d", ""]
    assert not stopped


def test_held_text_is_flushed_at_the_end() -> None:
    out, stopped = feed_all(["xyz"], ["abc x"])
    assert out == ["abc ", "x"]
    assert not stopped


def test_earliest_match_among_several_stops_wins() -> None:
    out, stopped = feed_all(["world", "lo"], ["hello world"])
    assert out == ["hel", ""]
    assert stopped


def test_overlapping_prefixes() -> None:
    out, stopped = feed_all(["aab"], ["a", "a", "a", "b"])
    assert out == ["", "", "a", "", ""]
    assert stopped


def test_stop_at_the_very_start_and_nothing_after_a_match() -> None:
    matcher = StopStringMatcher(["\n\n"])
    assert matcher.feed("\n\nmore") == ""
    assert matcher.feed("even more") == ""
    assert matcher.flush() == ""


def test_no_stop_strings_passes_everything() -> None:
    out, stopped = feed_all([], ["a", "b"])
    assert out == ["a", "b", ""]
    assert not stopped


def test_empty_stop_string_is_rejected() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        StopStringMatcher(["ok", ""])
