"""OpenAI request bodies: unknown fields ignored, vLLM extras honoured, unsupported ones refused."""

from __future__ import annotations

import pytest

from router.openai_models import ChatCompletionRequest, CompletionRequest
from router.validation import InvalidRequestError


def test_completion_fields_and_unknown_ones() -> None:
    body = CompletionRequest.model_validate(
        {"model": "m", "prompt": "hi", "stop": "\n", "top_k": 5, "ignore_eos": True, "stop_token_ids": [7],
         "logit_bias": {}, "user": "u", "stream": True, "stream_options": {"include_usage": True}}
    )
    request = body.to_input()
    assert (request.prompt, request.stop, request.top_k, request.ignore_eos, request.stop_token_ids) == (
        "hi", ("\n",), 5, True, (7,))
    assert (request.temperature, request.top_p, request.max_tokens) == (1.0, 1.0, None)
    assert body.include_usage


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_token_id_prompts(prompt) -> None:
    assert CompletionRequest(prompt=prompt).to_input().prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        ({"prompt": ["a", "b"]}, "a list of 2 prompts is not supported yet; send one", "prompt"),
    ],
)
def test_unsupported_completion_bodies(body: dict, message: str, param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        CompletionRequest.model_validate(body).to_input()
    assert (info.value.message, info.value.param) == (message, param)


def test_chat_content_parts_and_max_completion_tokens() -> None:
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_tokens": 3, "max_completion_tokens": 9}
    )
    request = body.to_input()
    assert (request.messages, request.max_tokens) == (({"role": "user", "content": "ab"},), 9)


def test_chat_image_part_is_refused() -> None:
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})
    with pytest.raises(InvalidRequestError, match="only text content parts are supported, got 'image_url'"):
        body.to_input()


def test_sampling_extras_and_completion_logprobs() -> None:
    request = CompletionRequest.model_validate(
        {"prompt": "hi", "n": 3, "logprobs": 2, "min_tokens": 4, "presence_penalty": 0.5, "frequency_penalty": None,
         "repetition_penalty": 1.2}
    ).to_input()
    assert (request.n, request.logprobs, request.min_tokens) == (3, 2, 4)
    assert (request.presence_penalty, request.frequency_penalty, request.repetition_penalty) == (0.5, 0.0, 1.2)
    plain = CompletionRequest(prompt="hi").to_input()
    assert (plain.logprobs, plain.repetition_penalty, plain.n) == (None, 1.0, 1)


@pytest.mark.parametrize(
    ("body", "logprobs"),
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": False}, None)],
)
def test_chat_logprobs_flag_and_top_logprobs(body: dict, logprobs: int | None) -> None:
    messages = [{"role": "user", "content": "hi"}]
    assert ChatCompletionRequest.model_validate({"messages": messages, **body}).to_input().logprobs == logprobs


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"top_logprobs": 2}, "top_logprobs requires logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20], got 21"),
    ],
)
def test_chat_top_logprobs_refused(body: dict, message: str) -> None:
    request = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(InvalidRequestError) as info:
        request.to_input()
    assert (info.value.message, info.value.param) == (message, "top_logprobs")
