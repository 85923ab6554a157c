"""The router's vLLM-compatible endpoints and completion options, as a real server against the
scripted fake workers of tests/integration/test_router.py (its module-scoped ``cluster``)."""

from __future__ import annotations

import asyncio
import importlib.metadata

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from core.grpc_service import aio_channel
from core.model_source import DEFAULT_MODEL
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.integration.test_router import EOS, MAX_MODEL_LEN, TEXT, Cluster, cluster, expected_logprobs, sse_events

pytestmark = pytest.mark.asyncio(loop_scope="module")
__all__ = ["cluster"]  # the fixture, imported to be used here


async def test_models_retrieve_and_not_found(cluster: Cluster) -> None:
    card = (await cluster.http.get(f"/v1/models/{DEFAULT_MODEL}")).json()
    assert card == {"id": DEFAULT_MODEL, "object": "model", "created": card["created"], "owned_by": "tandem",
                    "max_model_len": MAX_MODEL_LEN}
    missing = await cluster.http.get("/v1/models/org/gpt-4")
    assert missing.status_code == 404
    assert missing.json() == {"error": {
        "message": f'model "org/gpt-4" does not exist; this cluster serves "{DEFAULT_MODEL}"',
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}}
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.router.http_port}/v1", api_key="unused")
    assert (await client.models.retrieve(DEFAULT_MODEL)).id == DEFAULT_MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4")
    await client.close()


async def test_tokenize_a_prompt_and_a_chat(cluster: Cluster) -> None:
    tokenizer = cluster.tokenizer
    ids = tokenizer.encode("Hello, world!")
    got = (await cluster.http.post("/tokenize", json={"model": DEFAULT_MODEL, "prompt": "Hello, world!"})).json()
    assert got == {"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": None}
    strs = (await cluster.http.post("/tokenize", json={"prompt": "Hello, world!", "return_token_strs": True})).json()
    assert strs["token_strs"] == ["Hello", ",", "Ġworld", "!"]
    long = (await cluster.http.post("/tokenize", json={"prompt": "hi" * 100})).json()
    assert long["count"] == len(tokenizer.encode("hi" * 100)) > MAX_MODEL_LEN  # counted, not refused
    messages = [{"role": "user", "content": "hi"}]
    chat = (await cluster.http.post("/tokenize", json={"messages": messages})).json()
    assert chat["tokens"] == tokenizer.encode_chat(messages)
    bare = (await cluster.http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False})).json()
    assert tokenizer.hf.decode(bare["tokens"]) + "<|im_start|>assistant\n" == tokenizer.hf.decode(chat["tokens"])


@pytest.mark.parametrize(
    ("path", "body", "status", "message", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400,
         "send exactly one of prompt and messages", "prompt"),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, 404,
         f'model "gpt-4" does not exist; this cluster serves "{DEFAULT_MODEL}"', "model"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True}, 400,
         "add_generation_prompt and continue_final_message cannot both be true: the first starts a new assistant "
         "message, the second continues the last one", "continue_final_message"),
        ("/tokenize", {"prompt": "x", "add_special_token": True}, 400,
         "unrecognized request argument: add_special_token", "add_special_token"),
        ("/detokenize", {"tokens": [1, 49152]}, 400, "tokens has token id 49152, outside the vocabulary [0, 49152)",
         "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, 'tokens.0: Input should be a valid integer, got "a"', "tokens.0"),
    ],
)
async def test_tokenize_and_detokenize_errors(cluster: Cluster, path, body, status, message, param) -> None:
    response = await cluster.http.post(path, json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert (error["message"], error["param"]) == (message, param)


CHAT = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("path", "body", "message", "param"),
    [
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
         "stream_options is only allowed when stream is true", "stream_options"),
        ("/v1/chat/completions", {"messages": CHAT, "stream": False, "stream_options": {"include_usage": True}},
         "stream_options is only allowed when stream is true", "stream_options"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
         'messages.0.content is required on a "user" message (text or a list of content parts), got null',
         "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, *CHAT]},
         'messages.0.content is required on a "system" message (text or a list of content parts), got null',
         "messages.0.content"),
    ],
)
async def test_what_openai_refuses_is_a_400_before_any_worker(cluster: Cluster, path, body, message, param) -> None:
    num_prefills = len(cluster.fakes.prefill_requests)
    response = await cluster.http.post(path, json=body)
    assert response.status_code == 400
    assert response.json() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                         "code": None}}
    assert len(cluster.fakes.prefill_requests) == num_prefills


async def test_detokenize_keeps_special_tokens(cluster: Cluster) -> None:
    ids = cluster.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    got = (await cluster.http.post("/detokenize", json={"model": DEFAULT_MODEL, "tokens": ids})).json()
    assert got == {"prompt": cluster.tokenizer.hf.decode(ids)}
    assert got["prompt"].endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


async def test_version_and_ping(cluster: Cluster) -> None:
    assert (await cluster.http.get("/version")).json() == {"version": importlib.metadata.version("tandem-serve")}
    for method in ("GET", "POST"):
        ping = await cluster.http.request(method, "/ping")
        assert (ping.status_code, ping.content) == (200, b"")
    await cluster.deregister(("decode",))
    try:
        assert (await cluster.http.get("/ping")).status_code == 503  # as /health: no decode worker
    finally:
        await cluster.register()


async def test_a_list_of_prompts_answers_one_choice_per_prompt_and_n(cluster: Cluster) -> None:
    cluster.script_text("Hi there")
    num_prefills = len(cluster.fakes.prefill_requests)
    body = {"prompt": ["Say hi", "Go"], "n": 2, "max_tokens": 20, "seed": 3, "temperature": 0.5}
    data = (await cluster.http.post("/v1/completions", json=body)).json()
    assert [(c["index"], c["text"]) for c in data["choices"]] == [(i, "Hi there") for i in range(4)]
    prompts = sorted((tuple(p.prompt_token_ids), p.sampling_params.seed)
                     for p in cluster.fakes.prefill_requests[num_prefills:])
    say_hi, go = tuple(cluster.tokenizer.encode("Say hi")), tuple(cluster.tokenizer.encode("Go"))
    assert prompts == sorted([(say_hi, 3), (say_hi, 4), (go, 3), (go, 4)])
    num_generated = len(cluster.tokenizer.encode("Hi there")) + 1
    assert data["usage"]["prompt_tokens"] == len(say_hi) + len(go)  # each prompt once
    assert data["usage"]["completion_tokens"] == 4 * num_generated


async def test_a_list_of_prompts_streams_each_choice_with_its_index(cluster: Cluster) -> None:
    cluster.script_text()
    body = {"prompt": ["a", "b", "c"], "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    async with cluster.http.stream("POST", "/v1/completions", json=body) as response:
        events = await sse_events(response)
    chunks, usage_chunk = events[:-2], events[-2]
    for index in range(3):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert "".join(c["text"] for c in mine) == TEXT
        assert [c["finish_reason"] for c in mine][-1] == "stop"
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1, 2}
    prompt_tokens = sum(len(cluster.tokenizer.encode(p)) for p in "abc")
    assert usage_chunk["usage"]["prompt_tokens"] == prompt_tokens
    assert usage_chunk["usage"]["completion_tokens"] == 3 * (len(cluster.tokenizer.encode(TEXT)) + 1)


async def test_echo_prepends_the_prompt_streamed_or_not(cluster: Cluster) -> None:
    cluster.script_text(" there")
    data = (await cluster.http.post("/v1/completions", json={"prompt": ["Hi", "Yo"], "echo": True})).json()
    assert [c["text"] for c in data["choices"]] == ["Hi there", "Yo there"]
    data = (await cluster.http.post("/v1/completions", json={"prompt": [[5, 6], [1, 7]], "echo": True})).json()
    decoded = [cluster.tokenizer.hf.decode(ids) + " there" for ids in ([5, 6], [1, 7])]  # special tokens kept
    assert [c["text"] for c in data["choices"]] == decoded and decoded[1].startswith("<|im_start|>")
    async with cluster.http.stream("POST", "/v1/completions",
                                   json={"prompt": "Hi", "echo": True, "stream": True}) as response:
        events = await sse_events(response)
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts[0].startswith("Hi") and "".join(texts) == "Hi there"


async def test_best_of_returns_the_candidates_of_highest_cumulative_logprob(cluster: Cluster) -> None:
    script = cluster.script_text("Hi there")
    script.seed_logprob_offsets.update({11: 0.05, 12: 0.02})  # candidate 1 best, then candidate 2, then 0
    num_prefills = len(cluster.fakes.prefill_requests)
    body = {"prompt": "x", "n": 2, "best_of": 3, "seed": 10, "temperature": 1.0, "max_tokens": 20, "logprobs": 0}
    data = (await cluster.http.post("/v1/completions", json=body)).json()
    assert [c["index"] for c in data["choices"]] == [0, 1]
    num_tokens = len(cluster.tokenizer.encode("Hi there")) + 1
    firsts = [c["logprobs"]["token_logprobs"][0] for c in data["choices"]]
    assert firsts == [pytest.approx(-0.1 + 0.05, abs=1e-6), pytest.approx(-0.1 + 0.02, abs=1e-6)]
    assert data["usage"]["completion_tokens"] == 3 * num_tokens  # every candidate was generated
    assert sorted(p.sampling_params.seed for p in cluster.fakes.prefill_requests[num_prefills:]) == [10, 11, 12]
    # Without logprobs asked, the workers still send them (the ranking needs them); none is returned.
    data = (await cluster.http.post("/v1/completions", json={**body, "logprobs": None, "n": 1})).json()
    assert [(c["index"], c["logprobs"]) for c in data["choices"]] == [(0, None)]
    assert cluster.fakes.prefill_requests[-1].sampling_params.logprobs == 0


async def test_min_p_reaches_the_workers(cluster: Cluster) -> None:
    cluster.script_text("ok")
    body = {"messages": [{"role": "user", "content": "hi"}], "min_p": 0.125, "temperature": 0.7}
    assert (await cluster.http.post("/v1/chat/completions", json=body)).status_code == 200
    for sent in (cluster.fakes.prefill_requests[-1], cluster.fakes.decode_requests[-1]):
        assert sent.sampling_params.min_p == 0.125
    bad = await cluster.http.post("/v1/completions", json={"prompt": "x", "min_p": 2})
    assert (bad.status_code, bad.json()["error"]["message"]) == (400, "min_p must be in [0, 1], got 2.0")


async def test_skip_special_tokens_false_keeps_them_in_the_text(cluster: Cluster) -> None:
    text = "A<|im_start|>B"
    for skip, expected in ((None, "AB"), (True, "AB"), (False, text)):
        cluster.script_text(text)
        body = {"prompt": "x", "max_tokens": 20} | ({} if skip is None else {"skip_special_tokens": skip})
        assert (await cluster.http.post("/v1/completions", json=body)).json()["choices"][0]["text"] == expected


async def test_chat_template_kwargs_render_and_reserved_names_are_refused(cluster: Cluster) -> None:
    cluster.script_text("ok")
    messages = [{"role": "user", "content": "hi"}]
    body = {"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}
    assert (await cluster.http.post("/v1/chat/completions", json=body)).status_code == 200
    assert list(cluster.fakes.prefill_requests[-1].prompt_token_ids) == cluster.tokenizer.encode_chat(messages)
    bad = await cluster.http.post("/v1/chat/completions",
                                  json={"messages": messages, "chat_template_kwargs": {"add_generation_prompt": False}})
    assert bad.status_code == 400
    assert (bad.json()["error"]["message"], bad.json()["error"]["param"]) == (
        "chat_template_kwargs may not set add_generation_prompt", "chat_template_kwargs")


async def test_logprob_bytes_join_into_the_text_across_split_characters(cluster: Cluster) -> None:
    cluster.script_text()  # TEXT holds an emoji and CJK characters, each split over several tokens
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    data = (await cluster.http.post("/v1/chat/completions", json=body)).json()
    content = data["choices"][0]["logprobs"]["content"]
    assert [entry["logprob"] for entry in content] == expected_logprobs(cluster)
    assert b"".join(bytes(entry["bytes"]) for entry in content[:-1]).decode("utf-8") == TEXT
    assert bytes(content[-1]["bytes"]) == cluster.tokenizer.hf.decode([EOS]).encode()  # <|im_end|>
    assert any(entry["token"] == "\ufffd" for entry in content)  # a partial character's text
    assert all(bytes(top["bytes"]) == bytes(entry["bytes"]) for entry in content for top in entry["top_logprobs"])


async def test_vllm_request_metrics_carry_the_model_name(cluster: Cluster) -> None:
    cluster.script_text("ok")
    assert (await cluster.http.post("/v1/completions", json={"prompt": "x"})).status_code == 200
    text = (await cluster.http.get("/metrics")).text
    model = f'model_name="{DEFAULT_MODEL}"'
    families = ("vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
                "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    for name in families:
        assert f"{name}{{{model}}} " in text, name
    assert f'vllm:request_success_total{{finished_reason="stop",{model}}} ' in text  # labels sorted by name
    samples = [line for line in text.splitlines() if line.startswith("vllm:")]
    assert samples and all(model in line for line in samples)  # no vllm: sample without it


def _reflect(address: str) -> tuple[list[str], str, list[str]]:
    """What a reflection client learns from the server alone: its services, the input type of
    Router.Generate, and that type's field names."""
    with grpc.insecure_channel(address) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        pool = DescriptorPool(database)
        generate = pool.FindServiceByName("tandem.v1.Router").methods_by_name["Generate"]
        return sorted(database.get_services()), generate.input_type.full_name, [
            f.name for f in generate.input_type.fields]


async def test_grpc_server_reflection_lists_and_describes_the_router(cluster: Cluster) -> None:
    services, request_type, fields = await asyncio.to_thread(_reflect, f"127.0.0.1:{cluster.router.grpc_port}")
    assert services == ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection", "tandem.v1.Router"]
    assert request_type == "tandem.v1.GenerateRequest"
    assert fields == [f.name for f in router_pb2.GenerateRequest.DESCRIPTOR.fields]


async def test_echo_with_logprobs_returns_the_prompt_tokens_logprobs_first(cluster: Cluster) -> None:
    cluster.script_text("Hi there")
    prompt_ids = cluster.tokenizer.encode("Say hello to me")
    body = {"prompt": "Say hello to me", "echo": True, "logprobs": 1, "max_tokens": 20}
    data = (await cluster.http.post("/v1/completions", json=body)).json()
    assert cluster.fakes.prefill_requests[-1].sampling_params.prompt_logprobs == 1
    logprobs = data["choices"][0]["logprobs"]
    generated = cluster.tokenizer.encode("Hi there") + [EOS]
    assert logprobs["tokens"] == [cluster.tokenizer.token_text(t) for t in prompt_ids + generated]
    num_prompt = len(prompt_ids)
    assert logprobs["token_logprobs"][:num_prompt] == [None] + [pytest.approx(-k / 100) for k in range(1, num_prompt)]
    assert logprobs["token_logprobs"][num_prompt:] == expected_logprobs(cluster, "Hi there")
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {cluster.tokenizer.token_text(prompt_ids[1]): pytest.approx(-0.01)}
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    assert data["choices"][0]["text"] == "Say hello to meHi there"
    async with cluster.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = await sse_events(response)
    streamed = [t for e in events[:-1] if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == logprobs["tokens"]
    first = events[0]["choices"][0]
    assert first["text"].startswith("Say hello to me") and first["logprobs"]["token_logprobs"][0] is None


async def test_grpc_prompt_logprobs_come_with_the_first_delta(cluster: Cluster) -> None:
    cluster.script_text()
    channel = aio_channel(f"127.0.0.1:{cluster.router.grpc_port}")
    params = common_pb2.SamplingParams(max_tokens=40, prompt_logprobs=0)
    request = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=[5, 6, 7]), sampling_params=params)
    deltas = [r.delta async for r in router_pb2_grpc.RouterStub(channel).Generate(request) if r.HasField("delta")]
    await channel.close()
    assert [(lp.token_id, round(lp.logprob, 6)) for lp in deltas[0].prompt_logprobs] == [(6, -0.01), (7, -0.02)]
    assert all(not d.prompt_logprobs for d in deltas[1:])
