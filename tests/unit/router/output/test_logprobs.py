"""Logprobs in OpenAI's completion and chat shapes."""

from __future__ import annotations

from router.output.logprobs import MIN_LOGPROB, LogprobsFormatter, TokenLogprob
from router.api.openai_models import ChatShape, ChoiceResult, CompletionShape
from router.generation import Usage

TEXTS = {1: "Hel", 2: "lo", 3: " world", 4: "é"}


def test_completion_shape_keeps_a_running_text_offset_and_includes_the_sampled_token() -> None:
    f = LogprobsFormatter(TEXTS.__getitem__)
    first = f.completion([TokenLogprob(1, -0.5, ((1, -0.5), (3, -1.5)))])
    second = f.completion([TokenLogprob(2, -2.0, ((3, -1.0),)), TokenLogprob(3, float("-inf"))])
    assert first == {"tokens": ["Hel"], "token_logprobs": [-0.5], "top_logprobs": [{"Hel": -0.5, " world": -1.5}],
                     "text_offset": [0]}
    assert second["text_offset"] == [3, 5]
    assert second["top_logprobs"] == [{" world": -1.0, "lo": -2.0}, {" world": MIN_LOGPROB}]
    assert second["token_logprobs"] == [-2.0, MIN_LOGPROB]


def test_chat_shape_has_bytes_and_top_list() -> None:
    got = LogprobsFormatter(TEXTS.__getitem__).chat([TokenLogprob(4, -0.25, ((4, -0.25), (2, -3.0)))])
    assert got == {"content": [{"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9], "top_logprobs": [
        {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]}, {"token": "lo", "logprob": -3.0, "bytes": [108, 111]},
    ]}]}


def test_responses_carry_logprobs_only_when_asked_and_index_each_choice() -> None:
    usage = Usage(5, 3, 0)
    choices = [ChoiceResult(0, "Hel", "length", (TokenLogprob(1, -0.5),)), ChoiceResult(1, "lo", "stop")]
    plain = CompletionShape("cmpl-1", "m", 0).response(choices, usage)
    assert [(c["index"], c["logprobs"]) for c in plain["choices"]] == [(0, None), (1, None)]
    body = CompletionShape("cmpl-1", "m", 0, TEXTS.__getitem__).response(choices, usage)
    assert body["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
    assert body["choices"][1]["logprobs"]["tokens"] == []
    chat = ChatShape("chatcmpl-1", "m", 0, TEXTS.__getitem__)
    chunk = chat.chunk(1, "Hel", None, True, False, (TokenLogprob(1, -0.5),))
    assert chunk["choices"][0]["index"] == 1
    assert chunk["choices"][0]["logprobs"]["content"][0]["token"] == "Hel"
    assert chat.chunk(1, "", "stop", False, False)["choices"][0]["logprobs"] is None
