"""The disaggregated cluster (router → prefill → pool → decode, each its own process) on the
real SmolLM2-135M-Instruct model, against the Hugging Face reference, through real clients."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE

pytestmark = pytest.mark.e2e
MAX_TOKENS = 32
MODEL = "SmolLM2-135M-Instruct"


def expected_text(prompt: str, max_tokens: int = MAX_TOKENS) -> tuple[str, int]:
    tokens = reference.hf_greedy(reference.chat_ids(prompt), max_tokens)
    return reference.tokenizer().decode(tokens, skip_special_tokens=True), len(tokens)


def make_client(cluster) -> openai.AsyncOpenAI:
    """One client per event loop (each test runs its own asyncio.run)."""
    return openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0)


def grpc_generate(cluster, **fields) -> tuple[list[int], str, router_pb2.GenerateFinished]:
    with grpc.insecure_channel(cluster.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        token_ids, text, finished = [], "", None
        for msg in stub.Generate(router_pb2.GenerateRequest(**fields), timeout=300):
            if msg.HasField("delta"):
                token_ids += msg.delta.token_ids
                text += msg.delta.text
            else:
                finished = msg.finished
        return token_ids, text, finished


async def _chat(aclient, prompt: str, stream: bool):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0)
    if not stream:
        reply = await aclient.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.usage.completion_tokens
    text, usage = "", None
    async for chunk in await aclient.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    return text, usage.completion_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["non-stream", "stream"])
def test_openai_client_eight_prompts_at_once_equal_hf(cluster, probe, stream):
    async def all_at_once():
        async with make_client(cluster) as aclient:
            return await asyncio.gather(*(_chat(aclient, p, stream) for p in reference.PROMPTS))

    results = asyncio.run(all_at_once())
    for prompt, (text, num_tokens) in zip(reference.PROMPTS, results):
        assert (text, num_tokens) == expected_text(prompt), prompt


def test_grpc_tokens_equal_hf_and_repeat_hits_the_pool(cluster, probe):
    prompts = reference.PROMPTS[:4]
    for round_ in range(2):
        for prompt in prompts:
            ids = reference.chat_ids(prompt)
            tokens, text, finished = grpc_generate(
                cluster, chat=router_pb2.ChatMessages(messages=[router_pb2.ChatMessage(role="user", content=prompt)]),
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
            )
            assert tokens == reference.hf_greedy(ids, MAX_TOKENS), prompt
            assert finished.usage.prompt_tokens == len(ids)
            if round_ == 1:  # the same prompt again: its full blocks come from the pool
                # every full block is loaded; the last prompt token is always recomputed for its logits
                assert finished.usage.cached_tokens == min(len(ids) // BLOCK_SIZE * BLOCK_SIZE, len(ids) - 1) > 0
    assert probe.prefill_stats().num_cached_tokens > 0
    # both workers measured their pool reads (the router's KV-load estimate) and fitted a cost model
    for stats in (probe.prefill_stats(), probe.decode_stats()):
        assert stats.cost_kv_load_bytes_per_s > 0 and stats.cost_num_samples > 0
        assert stats.cost_kv_bytes_per_token == 30 * 2 * 3 * 64 * 4  # SmolLM2-135M: layers, K+V, kv heads, head_dim, fp32


def _counter(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return sample.value
    return 0.0


def test_the_decode_worker_runs_on_the_idle_prefill_core(cluster, probe):
    """engine.core_share: once the prefill worker has sent a prompt's first token it is idle, so
    the decode worker runs the request's passes on its cores too, greedy tokens still HF's."""
    if not cluster._shared_threads:
        pytest.skip("one core here: nothing to share")
    decode = cluster.metrics_urls["decode"]
    name = "tandem:core_share_passes_total"
    before = _counter(decode, name, {"cores": "borrowed"}), _counter(decode, name, {"cores": "own"})
    ids = reference.chat_ids(reference.PROMPTS[0])
    tokens, _, _ = grpc_generate(cluster, token_ids=router_pb2.TokenIds(ids=ids),
                                 sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    assert tokens == reference.hf_greedy(ids, MAX_TOKENS)
    def passes():  # the engine thread counts a pass just after handing its token over
        borrowed = _counter(decode, name, {"cores": "borrowed"}) - before[0]
        own = _counter(decode, name, {"cores": "own"}) - before[1]
        return (borrowed, own) if borrowed + own >= len(tokens) - 1 else None

    borrowed, own = poll_until(passes, message="a pass counted per decoded token")
    # one pass per token after the first (the prefill worker's); the first may start before the
    # prefill worker's loop has let its cores go
    assert len(tokens) > 4 and borrowed + own == len(tokens) - 1 and borrowed >= len(tokens) - 2
    assert _counter(cluster.metrics_urls["prefill"], "tandem:core_share_wait_seconds_total") >= 0.0


@pytest.mark.parametrize("num_prompt_tokens", [1, BLOCK_SIZE - 1, BLOCK_SIZE, BLOCK_SIZE + 1])
def test_prompt_lengths_around_a_block(cluster, probe, num_prompt_tokens):
    ids = reference.chat_ids("Tell me a story about a lighthouse keeper and the sea.")[:num_prompt_tokens]
    tokens, _, finished = grpc_generate(
        cluster, token_ids=router_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=12),
    )
    assert tokens == reference.hf_greedy(ids, 12)


def test_max_tokens_one_gives_exactly_one_token(cluster, probe):
    async def once():
        async with make_client(cluster) as aclient:
            return await aclient.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                                    temperature=0)

    reply = asyncio.run(once())
    assert reply.usage.completion_tokens == 1 and reply.choices[0].finish_reason == "length"
    ids = reference.tokenizer()("The capital of France is")["input_ids"]
    assert reply.choices[0].text == reference.tokenizer().decode(reference.hf_greedy(ids, 1))


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "max_tokens": 1030}, "1024"),
        ({"prompt": "word " * 1100}, "1024"),
    ],
)
def test_bad_input_gets_400_and_the_cluster_goes_on(cluster, probe, body, fragment):
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert fragment in reply.json()["error"]["message"]
    good = httpx.post(f"{cluster.http_url}/v1/completions",
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_unknown_model_and_malformed_json(cluster, probe):
    reply = httpx.post(f"{cluster.http_url}/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=30)
    assert reply.status_code in (400, 404) and "nope" in reply.json()["error"]["message"]
    reply = httpx.post(f"{cluster.http_url}/v1/completions", content=b"{not json", timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400


def test_stream_disconnect_frees_decode_blocks_at_the_next_pass(cluster, probe):
    """A client leaving mid-stream aborts the request at the decode worker's next pass boundary:
    its blocks go back and it stops within a few tokens of the disconnect instead of running
    its 500. (Counted in tokens, not seconds: one pass takes ~30 ms on a quiet machine and over
    a second on a CI machine whose two cores run other tests beside the cluster.)"""
    body = {"model": MODEL, "prompt": "Count from one to one thousand:", "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    generated_before = probe.decode_stats().num_generated_tokens
    lines: list[str] = []
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{cluster.http_url}/v1/completions", json=body) as r:
        # Held, not a bare `for line in r.iter_lines()`: the loop's break would drop the last
        # reference to the generator, and closing it closes the connection, a disconnect that
        # raced the check below (and won once the router and decode worker were quick).
        stream = r.iter_lines()
        for line in stream:
            lines.append(line)
            if sum(one.startswith("data: ") for one in lines) >= 5:  # the first token and 4 decoded
                break
        poll_until(lambda: probe.decode_stats().num_used_blocks > 0, timeout_s=30,
                   message=f"the decode worker holding the open stream's blocks (stream so far: {lines})")
        stream.close()
    poll_until(lambda: probe.decode_stats().num_used_blocks == 0, timeout_s=60, message="decode blocks freed")
    generated = probe.decode_stats().num_generated_tokens - generated_before
    assert 4 <= generated < 64, lines
