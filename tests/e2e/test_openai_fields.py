"""vLLM's request fields and endpoints on the disaggregated cluster with the real model, against
the Hugging Face reference: list prompts, echo, best_of, min_p, /tokenize, /detokenize, and
logprob bytes that join into the text across split characters."""

from __future__ import annotations

import httpx
import pytest

from tests import reference
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 16


def post(cluster, path: str, body: dict) -> dict:
    response = httpx.post(f"{cluster.http_url}{path}", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def hf_text(prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> str:
    return reference.tokenizer().decode(reference.hf_greedy(prompt_ids, max_tokens), skip_special_tokens=True)


def test_logprob_bytes_join_into_japanese_text(cluster, probe):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Translate to Japanese: good morning"}],
            "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    choice = post(cluster, "/v1/chat/completions", body)["choices"][0]
    content = choice["logprobs"]["content"]
    text = choice["message"]["content"]
    assert text == hf_text(reference.chat_ids(body["messages"][0]["content"]), 24)
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    special = b"<|im_end|>" if choice["finish_reason"] == "stop" else b""  # EOS: in the logprobs, not the text
    assert joined == text.encode("utf-8") + special
    assert any(entry["token"] == "\ufffd" for entry in content)  # some token holds part of a character
    assert any(ord(c) > 0x3000 for c in text)  # Japanese (or CJK) text came back


def test_a_list_of_prompts_with_echo_equals_hf_for_each(cluster, probe):
    prompts = [reference.PROMPTS[0], reference.PROMPTS[1]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0, "echo": True}
    choices = post(cluster, "/v1/completions", body)["choices"]
    tok = reference.tokenizer()
    expected = [p + hf_text(tok.encode(p)) for p in prompts]
    assert [(c["index"], c["text"]) for c in choices] == list(enumerate(expected))


def test_min_p_1_keeps_only_the_most_likely_token(cluster, probe):
    prompt = reference.PROMPTS[2]
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 1.0, "min_p": 1.0, "seed": 7}
    text = post(cluster, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert text == hf_text(reference.chat_ids(prompt))  # sampling from the argmax alone is greedy


def test_best_of_returns_candidates_by_cumulative_logprob(cluster, probe):
    body = {"model": MODEL, "prompt": reference.PROMPTS[3], "max_tokens": 8, "temperature": 1.0, "seed": 1,
            "n": 2, "best_of": 4, "logprobs": 0}
    data = post(cluster, "/v1/completions", body)
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in data["choices"]]
    assert [c["index"] for c in data["choices"]] == [0, 1] and sums[0] >= sums[1]
    # The two returned are the best of the four seeded candidates (seeds 1..4): each alone, as n=1.
    alone = [post(cluster, "/v1/completions", {**body, "n": 1, "best_of": None, "seed": s})["choices"][0]
             for s in range(1, 5)]
    best = sorted((sum(c["logprobs"]["token_logprobs"]) for c in alone), reverse=True)[:2]
    assert sums == pytest.approx(best, abs=1e-4)
    assert data["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in alone)


def test_tokenize_and_detokenize_match_the_tokenizer(cluster, probe):
    messages = [{"role": "user", "content": reference.PROMPTS[0]}]
    got = post(cluster, "/tokenize", {"model": MODEL, "messages": messages})
    assert got["tokens"] == reference.chat_ids(reference.PROMPTS[0]) and got["count"] == len(got["tokens"])
    assert post(cluster, "/detokenize", {"tokens": got["tokens"]})["prompt"] == reference.tokenizer().decode(got["tokens"])


def test_echo_with_logprobs_gives_the_prompt_logprobs_of_hf(cluster, probe):
    prompt = reference.PROMPTS[4]
    ids = reference.tokenizer().encode(prompt)
    expected = reference.hf_prompt_logprobs(tuple(ids))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    for _ in range(2):  # the second time the pool holds the prompt's blocks: computed all the same
        choice = post(cluster, "/v1/completions", body)["choices"][0]
        logprobs = choice["logprobs"]
        assert choice["text"].startswith(prompt)
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        got = logprobs["token_logprobs"][1 : len(ids)]
        assert got == pytest.approx([float(expected[p, t]) for p, t in enumerate(ids[1:])], abs=2e-3)
        assert len(logprobs["tokens"]) == len(ids) + 4
    poll_until(probe.is_idle, timeout_s=10.0, message="every block and lease released")
