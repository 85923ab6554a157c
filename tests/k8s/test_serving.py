"""The release serves: 24 real prompts streamed through the official openai client via the
router's NodePort on 127.0.0.1 equal Hugging Face greedy, and each went router -> prefill pod ->
KV pool -> decode pod (the workers' own counters moved)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.k8s.load import MODEL, PROMPTS, Load

pytestmark = pytest.mark.k8s


def test_24_prompts_streamed_through_openai_equal_hf(baseline, references, record):
    node = baseline
    models = httpx.get(f"{node.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    (prefill,), (decode,) = node.pods("prefill"), node.pods("decode")
    before = node.worker_stats("prefill", prefill), node.worker_stats("decode", decode)

    async def run():
        async with Load(node.url, concurrency=8) as load:
            return await load.finish()

    tally = asyncio.run(run())
    after = node.worker_stats("prefill", prefill), node.worker_stats("decode", decode)
    prefill_tokens = after[0].num_prefill_tokens - before[0].num_prefill_tokens
    generated = after[1].num_generated_tokens - before[1].num_generated_tokens
    record("24 prompts, openai client, streamed", **tally.as_dict(), prefill_pod_prompt_tokens=prefill_tokens,
           decode_pod_generated_tokens=generated)
    assert (tally.sent, tally.completed, tally.lost, tally.wrong) == (len(PROMPTS), 24, 0, 0), tally.errors
    assert prefill_tokens > 0 and generated > 0  # disaggregated on the pods (routing.disaggregation: always)
