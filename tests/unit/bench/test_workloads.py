"""Prompt-set workloads and the client's request bodies."""

import json

import pytest

from bench.client import ClientConfig, request_body
from bench.workloads import BenchRequest, WorkloadConfig, load_workload


def test_sharegpt_and_alpaca_rows_become_chat_prompts_with_fixed_max_tokens(tmp_path):
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi there"}]},
                                    {"id": "b", "conversations": [{"from": "human", "value": "x" * 50}]}]))
    alpaca = tmp_path / "alpaca.json"
    alpaca.write_text(json.dumps([{"instruction": "list 3 fruits", "output": "...", "dataset": "koala"}]))
    requests = load_workload(WorkloadConfig("sharegpt", sharegpt, max_tokens=12, max_prompt_chars=20))
    assert requests == [BenchRequest("hi there", 12)]  # the 50-char prompt is over max_prompt_chars
    assert load_workload(WorkloadConfig("alpaca", alpaca, max_tokens=5))[0].prompt == "list 3 fruits"


def test_prompt_set_needs_max_tokens():
    with pytest.raises(ValueError, match="max_tokens > 0"):
        WorkloadConfig("sharegpt", "x.json")


def test_token_prompts_go_to_completions_and_text_to_chat():
    config = ClientConfig("http://h:1", "m", ignore_eos=True)
    path, body = request_body(BenchRequest([1, 2, 3], 7), config)
    assert path == "/v1/completions" and body["prompt"] == [1, 2, 3] and body["max_tokens"] == 7
    assert body["ignore_eos"] is True and body["stream"] is True
    path, body = request_body(BenchRequest("hello", 7), ClientConfig("http://h:1", "m"))
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert "ignore_eos" not in body


def test_without_a_path_prompt_sets_repeat_the_builtin_prompts():
    from bench.prompts import BUILTIN_PROMPTS

    requests = load_workload(WorkloadConfig("sharegpt", None, num_requests=10, max_tokens=4))
    assert [r.prompt for r in requests] == BUILTIN_PROMPTS + BUILTIN_PROMPTS[:2]
    assert {r.max_tokens for r in requests} == {4}
    with pytest.raises(ValueError, match=r"^the mooncake workload needs a trace file \(--path\)$"):
        WorkloadConfig("mooncake", None)
