"""Structured outputs on the real model through the engine alone: a grammar changes a greedy
answer only where the unconstrained token was not allowed, JSON answers validate against their
schema, the first token (a prefill worker's) obeys the grammar and the decode side continues it
from tokens, a resumed request continues its grammar, and a spec the grammar library refuses is
refused with the library's reason."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from core.request import FinishReason, Request
from core.sampling_params import SamplingParams
from core.structured_output import StructuredOutputSpec
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.kv_connector.decode_start import append_outputs
from engine.outputs import ExternalKV
from tests import reference

BLOCK_SIZE = 16
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def make_engine(**overrides) -> LLMEngine:
    config = dict(block_size=BLOCK_SIZE, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=512)
    return LLMEngine.from_config(EngineConfig(**{**config, **overrides}), save_kv_on_finish=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def overlap_engine(engine: LLMEngine) -> LLMEngine:
    config = EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=512,
                          enable_overlap=True, num_scheduler_steps=2)
    return LLMEngine(config, engine.runner.model, engine.source)


def run_all(engine: LLMEngine, requests: list[Request], external: dict[str, ExternalKV] | None = None) -> dict:
    """Runs ``requests`` in one batch to the end; request id -> its finished RequestOutput, and
    every block back to free."""
    finished = {}
    for r in requests:
        engine.add_request(r, (external or {}).get(r.request_id))
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished[o.request_id] = o
    assert engine.stats().num_used_blocks == 0
    return finished


def greedy(prompt: list[int], max_tokens: int, spec: StructuredOutputSpec | None = None, rid: str = "r") -> Request:
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=spec))


def text(token_ids: list[int]) -> str:
    return reference.tokenizer().decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("engine_name", ["engine", "overlap_engine"])
def test_a_grammar_admitting_the_greedy_answer_leaves_it_unchanged(request, engine_name: str) -> None:
    """A regex that admits exactly the unconstrained answer (any tokenization of it): every
    greedy token was allowed, so the constrained run equals it token for token."""
    engine = request.getfixturevalue(engine_name)
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS[:3]]
    free = [greedy(p, 12, rid=f"free{i}") for i, p in enumerate(prompts)]
    free_outputs = run_all(engine, free)
    assert [r.output_token_ids for r in free] == [reference.hf_greedy(p, 12) for p in prompts]
    constrained = [greedy(p, 12, StructuredOutputSpec("regex", literal(text(r.output_token_ids))), f"c{i}")
                   for i, (p, r) in enumerate(zip(prompts, free))]
    outputs = run_all(engine, constrained + [greedy(prompts[0], 12, rid="plain")])
    assert [r.output_token_ids for r in constrained] == [r.output_token_ids for r in free]
    assert [outputs[r.request_id].finish_reason for r in constrained] == [free_outputs[r.request_id].finish_reason
                                                                           for r in free]


def literal(text: str) -> str:
    """A regex matching exactly ``text`` (only the metacharacters escaped: the grammar library's
    regex dialect refuses Python's escaped spaces)."""
    return re.sub(r"([.^$*+?{}\[\]\\|()])", r"\\\1", text)


def test_a_json_schema_answer_diverges_only_where_it_must_and_validates(engine: LLMEngine) -> None:
    prompt = reference.chat_ids("Give me a person as JSON with a name and an age.")
    free = greedy(prompt, 40, rid="free")
    structured = greedy(prompt, 80, StructuredOutputSpec.json_schema(PERSON, strict=True), "json")
    outputs = run_all(engine, [free, structured])
    answer = json.loads(text(structured.output_token_ids))
    jsonschema.validate(answer, PERSON)
    assert outputs["json"].finish_reason is FinishReason.STOP
    assert structured.output_token_ids[-1] == engine.eos_token_id
    # Where the unconstrained greedy token was allowed the constrained run took it: the first
    # divergence is a token the schema forbids at that point.
    both = zip(free.output_token_ids, structured.output_token_ids)
    first_diff = next(i for i, (a, b) in enumerate(both) if a != b)
    prefix = text(structured.output_token_ids[:first_diff]) + reference.tokenizer().decode([free.output_token_ids[first_diff]])
    assert not _json_prefix_fits(prefix)


def _json_prefix_fits(prefix: str) -> bool:
    """Whether ``prefix`` can start compact JSON of PERSON: a rough check, exact for the cases
    this test meets (the model's free answer starts with prose or a code fence)."""
    return prefix.startswith('{"name":"') or prefix == "{" or prefix == '{"' or '{"name"'.startswith(prefix)


def test_json_schema_answers_for_real_prompts_validate(engine: LLMEngine) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 60},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    spec = StructuredOutputSpec.json_schema(schema, strict=True)
    requests = [greedy(reference.chat_ids(p + " Answer in JSON."), 120, spec, f"q{i}")
                for i, p in enumerate(reference.PROMPTS)]
    outputs = run_all(engine, requests)
    for r in requests:
        assert outputs[r.request_id].finish_reason is FinishReason.STOP, text(r.output_token_ids)
        jsonschema.validate(json.loads(text(r.output_token_ids)), schema)


def test_the_first_token_obeys_the_grammar_and_the_decode_side_continues_from_it(engine: LLMEngine) -> None:
    """The disaggregated flow on two engines: the prefill side samples only the first token
    (max_tokens 1) under the grammar; the decode side gets the prompt's KV and that token and
    rebuilds the matcher from it. Had the prefill side sampled unconstrained, its first token
    (" The" here, not "Z") would not fit and the decode side would refuse it."""
    prompt = reference.chat_ids(reference.PROMPTS[0])
    unconstrained_first = reference.hf_greedy(prompt, 1)[0]
    spec = StructuredOutputSpec.choice(["Zebra crossing", "Zeppelin"])
    prefill = greedy(prompt, 1, spec, "prefill")
    saved = run_all(engine, [prefill])["prefill"].saved_kv
    first = prefill.output_token_ids[0]
    assert first != unconstrained_first
    assert "Zebra crossing".startswith(text([first])) or "Zeppelin".startswith(text([first]))
    decode = greedy(prompt, 16, spec, "decode")
    append_outputs(decode, [first])
    run_all(make_decode_engine(engine), [decode], {"decode": ExternalKV(len(prompt), saved)})
    assert text(decode.output_token_ids) in ("Zebra crossing", "Zeppelin")
    assert decode.finish_reason is FinishReason.STOP


def make_decode_engine(engine: LLMEngine) -> LLMEngine:
    return LLMEngine(engine.config, engine.runner.model, engine.source)


def test_decode_refuses_a_first_token_outside_the_grammar(engine: LLMEngine) -> None:
    prompt = reference.chat_ids(reference.PROMPTS[0])
    decode = greedy(prompt, 16, StructuredOutputSpec.choice(["Zeppelin"]), "decode")
    append_outputs(decode, reference.hf_greedy(prompt, 1))
    decode_engine = make_decode_engine(engine)
    decode_engine.add_request(decode)
    outputs = []
    while decode_engine.has_unfinished_requests():
        outputs += decode_engine.step()
    assert [(o.finished, o.error) for o in outputs] == [(True, "output token 0 (id 504) does not fit the structured output")]
    assert decode_engine.request_ids() == []


def test_a_resumed_request_continues_its_grammar(engine: LLMEngine) -> None:
    prompt = reference.chat_ids("Give me a person as JSON with a name and an age.")
    spec = StructuredOutputSpec.json_schema(PERSON, strict=True)
    whole = greedy(prompt, 80, spec, "whole")
    run_all(engine, [whole])
    for k in (3, 7):
        resumed = greedy(prompt, 80, spec, f"resumed{k}")
        append_outputs(resumed, whole.output_token_ids[:k])
        run_all(make_decode_engine(engine), [resumed])
        assert resumed.output_token_ids == whole.output_token_ids
    jsonschema.validate(json.loads(text(whole.output_token_ids)), PERSON)


def test_a_spec_the_library_cannot_compile_is_refused_and_others_run(engine: LLMEngine) -> None:
    prompt = reference.chat_ids(reference.PROMPTS[1])
    bad = greedy(prompt, 8, StructuredOutputSpec("regex", "(?<=a)b"), "bad")
    good = greedy(prompt, 8, rid="good")
    engine.add_request(bad)
    engine.add_request(good)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    refused = [o for o in outputs if o.request_id == "bad"]
    assert [(o.finished, o.error) for o in refused] == [
        (True, "the regex cannot be compiled: Regex parsing error at position 3: Lookbehind is not supported yet.")]
    assert good.output_token_ids == reference.hf_greedy(prompt, 8)


def test_a_preempted_request_keeps_its_grammar(engine: LLMEngine) -> None:
    """Three constrained requests in a cache of 8 blocks that cannot hold them all: some are
    preempted (recomputed) mid-answer, keep their matchers, and answer as on an ample cache."""
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS[:3]]
    free = [greedy(p, 40, rid=f"free{i}") for i, p in enumerate(prompts)]
    run_all(engine, free)
    small = LLMEngine(EngineConfig(block_size=BLOCK_SIZE, num_kv_blocks=8, max_model_len=128,
                                   max_num_batched_tokens=128), engine.runner.model, engine.source)
    constrained = [greedy(p, 40, StructuredOutputSpec("regex", literal(text(r.output_token_ids))), f"c{i}")
                   for i, (p, r) in enumerate(zip(prompts, free))]
    run_all(small, constrained)
    assert small.stats().num_preemptions > 0
    assert [r.output_token_ids for r in constrained] == [r.output_token_ids for r in free]
