"""`tandem up --colocated`: no prefill worker; the decode worker prefills in chunks mixed into its
decode steps. Greedy answers equal the reference, and blocks return to idle. On the shared
colocated cluster (tests/e2e/conftest.py: its 32-token step budget chunks every chat prompt)."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest

from tandem.v1 import decode_worker_pb2_grpc, prefill_worker_pb2
from tests import reference
from tests.conftest import poll_until

pytestmark = pytest.mark.e2e
MAX_TOKENS = 24


def test_colocated_cluster_answers_like_the_reference(colocated_cluster):
    assert set(colocated_cluster.addresses) == {"kv_pool", "decode"}
    health = httpx.get(f"{colocated_cluster.http_url}/health", timeout=10).json()
    assert health["mode"] == "colocated" and health["workers"]["prefill"] == 0

    async def ask_all():
        url = f"{colocated_cluster.http_url}/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as client:
            replies = await asyncio.gather(*(
                client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=MAX_TOKENS, temperature=0,
                                               messages=[{"role": "user", "content": p}])
                for p in reference.PROMPTS[:4]
            ))
            return [(r.choices[0].message.content, r.usage.completion_tokens) for r in replies]

    for prompt, (text, num_tokens) in zip(reference.PROMPTS[:4], asyncio.run(ask_all())):
        expected = reference.hf_greedy(reference.chat_ids(prompt), MAX_TOKENS)
        assert (text, num_tokens) == (reference.tokenizer().decode(expected, skip_special_tokens=True), len(expected))
    decode = decode_worker_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(colocated_cluster.addresses["decode"]))
    poll_until(lambda: decode.GetStats(prefill_worker_pb2.GetWorkerStatsRequest(), timeout=5).num_used_blocks == 0,
               timeout_s=5, message="decode blocks back to idle")


def test_colocated_echo_with_logprobs_and_a_list_of_prompts(colocated_cluster):
    """The decode worker prefills in chunks of 32 and sends the prompt logprobs with the first token."""
    prompts = reference.PROMPTS[4:6]
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompts, "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 1}
    choices = httpx.post(f"{colocated_cluster.http_url}/v1/completions", json=body, timeout=300).json()["choices"]
    for choice, prompt in zip(choices, prompts):
        ids = reference.tokenizer().encode(prompt)
        expected = reference.hf_prompt_logprobs(tuple(ids))
        logprobs = choice["logprobs"]["token_logprobs"]
        generated = reference.hf_greedy(ids, 4)  # EOS may end it sooner
        assert logprobs[0] is None and len(logprobs) == len(ids) + len(generated)
        assert logprobs[1 : len(ids)] == pytest.approx([float(expected[p, t]) for p, t in enumerate(ids[1:])],
                                                       abs=2e-3)
        assert choice["text"] == prompt + reference.tokenizer().decode(generated, skip_special_tokens=True)
    assert [c["index"] for c in choices] == [0, 1]
