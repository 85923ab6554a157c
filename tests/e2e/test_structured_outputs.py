"""Structured outputs through the whole cluster with the official ``openai`` client: JSON-schema
answers validate for 32 requests (disaggregated and colocated), ``beta.chat.completions.parse``
returns the pydantic object, the prefill worker's first token obeys the grammar, grammars the
engine cannot compile are 400s naming the field (INVALID_ARGUMENT on gRPC), and a JSON-schema
stream whose decode worker is killed mid-way resumes on the other one and still validates.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
import httpx
import jsonschema
import openai
import pydantic
import pytest

from launcher.config import ClusterConfig
from launcher.local_cluster import LocalCluster
from launcher.ports import free_port
from tandem.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests import reference
from tests.conftest import poll_until
from tests.e2e.conftest import BLOCK_SIZE, ClusterProbe

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
TIMEOUT_S = 300.0

# Four schemas x the eight reference prompts = 32 requests; every string and number is bounded,
# so a 135M model cannot run past max_tokens inside one.
SCHEMAS = [
    {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 30},
                                      "difficulty": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["topic", "difficulty"], "additionalProperties": False},
    {"type": "object", "properties": {"keywords": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                   "minItems": 1, "maxItems": 3}},
     "required": ["keywords"], "additionalProperties": False},
    {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 40},
                                      "sentiment": {"enum": ["positive", "neutral", "negative"]},
                                      "certain": {"type": "boolean"}},
     "required": ["summary", "sentiment", "certain"], "additionalProperties": False},
]
MAX_TOKENS = 120


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=120)


def make_cluster(tmp_path_factory, **options) -> LocalCluster:
    return LocalCluster(ClusterConfig.from_options(
        model=MODEL, http_port=free_port(), grpc_port=free_port(), block_size=BLOCK_SIZE, num_kv_blocks=256,
        max_model_len=1024, max_num_batched_tokens=512, log_dir=tmp_path_factory.mktemp("structured-logs"), **options))


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory):
    """One prefill and two decode workers, every request disaggregated (the last test kills one)."""
    with make_cluster(tmp_path_factory, num_decode_workers=2, disaggregation="always") as cluster:
        cluster.start()
        yield cluster


def client(cluster: LocalCluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{cluster.http_url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)


def response_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def ask_all_json(cluster: LocalCluster) -> list[tuple[dict, str, str]]:
    """(schema, answer text, finish reason) of each of the 32 requests, sent at once."""
    async with client(cluster) as c:
        jobs = [(schema, prompt) for schema in SCHEMAS for prompt in reference.PROMPTS]
        replies = await asyncio.gather(*(
            c.chat.completions.create(model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                                      messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
                                      response_format=response_format(schema))
            for schema, prompt in jobs))
    return [(schema, r.choices[0].message.content, r.choices[0].finish_reason) for (schema, _), r in zip(jobs, replies)]


def assert_all_validate(answers: list[tuple[dict, str, str]]) -> None:
    assert len(answers) == 32
    for schema, text, finish_reason in answers:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def assert_idle(cluster: LocalCluster) -> None:
    probe = ClusterProbe(cluster)
    poll_until(probe.is_idle, timeout_s=30, message="blocks, leases and scoped blocks back to idle")


def test_json_schema_answers_validate_disaggregated(disaggregated) -> None:
    assert_all_validate(asyncio.run(ask_all_json(disaggregated)))
    assert_idle(disaggregated)


def test_json_schema_answers_validate_colocated(colocated_cluster) -> None:
    """On the colocated cluster the tool-call tests share (tests/e2e/conftest.py)."""
    assert_all_validate(asyncio.run(ask_all_json(colocated_cluster)))
    assert_idle(colocated_cluster)


def test_parse_returns_the_pydantic_object_and_choices_hold_from_the_first_token(disaggregated) -> None:
    """``parse`` sends the model's strict schema and reads the answer back as the model. A
    guided choice whose unconstrained first token is something else: the prefill worker's first
    token must obey the grammar (a decode worker given another first token refuses it)."""
    prompt = reference.PROMPTS[0]
    unconstrained = reference.tokenizer().decode(reference.hf_greedy(reference.chat_ids(prompt), 1))
    choices = ["Zebra crossing", "Zeppelin"]
    assert not any(c.startswith(unconstrained) for c in choices)

    async def ask():
        async with client(disaggregated) as c:
            parsed = await c.beta.chat.completions.parse(
                model=MODEL, temperature=0, max_tokens=MAX_TOKENS, response_format=Person,
                messages=[{"role": "user", "content": "Invent a person with a name and an age, as JSON."}])
            chosen = await c.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=16, messages=[{"role": "user", "content": prompt}],
                extra_body={"guided_choice": choices})
            streamed = await c.completions.create(
                model=MODEL, prompt="The year the first moon landing happened was", temperature=0, max_tokens=8,
                stream=True, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
            return parsed, chosen, "".join([chunk.choices[0].text async for chunk in streamed if chunk.choices])

    parsed, chosen, year = asyncio.run(ask())
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person)
    assert Person.model_validate_json(parsed.choices[0].message.content) == person
    assert chosen.choices[0].message.content in choices and chosen.choices[0].finish_reason == "stop"
    assert len(year) == 4 and year.isdigit()
    assert_idle(disaggregated)


def test_a_grammar_the_engine_cannot_compile_is_a_400_naming_the_field(disaggregated) -> None:
    async def ask():
        async with client(disaggregated) as c:
            with pytest.raises(openai.BadRequestError) as info:
                await c.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={"guided_regex": "(?<=a)b"})
            return info.value

    err = asyncio.run(ask())
    assert (err.status_code, err.body["param"]) == (400, "guided_regex")
    assert err.body["message"].endswith(
        "the regex cannot be compiled: Regex parsing error at position 3: Lookbehind is not supported yet.")
    with grpc.insecure_channel(disaggregated.grpc_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        bad = common_pb2.SamplingParams(max_tokens=4, structured_outputs=common_pb2.StructuredOutput(
            kind="grammar", value='root ::= "a" |'))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(router_pb2.GenerateRequest(text="x", sampling_params=bad), timeout=TIMEOUT_S))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "the grammar cannot be compiled: EBNF parser error at line 1" in info.value.details()
        schema = common_pb2.SamplingParams(max_tokens=4, structured_outputs=common_pb2.StructuredOutput(
            kind="json_schema", value="{"))
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(router_pb2.GenerateRequest(text="x", sampling_params=schema), timeout=TIMEOUT_S))
        assert (info.value.code(), info.value.details()) == (
            grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.structured_outputs: the schema is not valid JSON: "
                                              "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")
    assert_idle(disaggregated)


def test_kill_a_decode_worker_mid_json_stream(disaggregated) -> None:
    """Sixteen JSON-schema streams; a decode worker that streams some of them is SIGKILLed mid-way:
    its streams resume on the other one from the tokens already sent (the matcher rebuilt from
    them), and every final text validates."""
    probe = ClusterProbe(disaggregated)
    # A long answer (200 to 240 characters) keeps every stream going well past the kill;
    # max_tokens 300 leaves room for more than one token per character (greedy: deterministic).
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 200, "maxLength": 240}},
              "required": ["story"], "additionalProperties": False}
    num_tokens = 0
    changed = asyncio.Event()

    async def stream(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        nonlocal num_tokens
        text, finish = "", None
        chunks = await c.chat.completions.create(
            model=MODEL, max_tokens=300, temperature=0, stream=True, response_format=response_format(schema),
            messages=[{"role": "user", "content": prompt + " Answer in JSON."}])
        async for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                num_tokens += 1
                changed.set()
        return text, finish

    def victim() -> str | None:
        """A decode worker with streams running (the router may have placed them all on one)."""
        return next((name for name in ("decode-1", "decode")
                     if probe.worker_stats(name).num_requests_running > 0), None)

    async def run():
        async with client(disaggregated) as c:
            tasks = [asyncio.create_task(stream(c, reference.PROMPTS[i % 8])) for i in range(16)]
            name = None
            while num_tokens < 16 * 8 or (name := await asyncio.to_thread(victim)) is None:
                changed.clear()
                try:
                    await asyncio.wait_for(changed.wait(), timeout=0.5)
                except TimeoutError:
                    assert not all(t.done() for t in tasks), "every stream ended before the kill"
            os.kill(disaggregated.service(name).process.pid, signal.SIGKILL)
            killed_at = num_tokens
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=TIMEOUT_S), killed_at

    results, killed_at = asyncio.run(run())
    assert killed_at < num_tokens  # streams went on after the kill
    metrics = httpx.get(f"{disaggregated.http_url}/metrics", timeout=10).text
    assert sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("tandem:migrations_total")) >= 1
    for text, finish in results:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)
