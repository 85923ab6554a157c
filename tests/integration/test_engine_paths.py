"""Every execution path of the engine's forward gives the Hugging Face reference's greedy tokens
on the real model (docs/design.md §8): eager or compiled (``enforce_eager``) x the CPU backend (C
decode kernel, SDPA prompt chunks) or the readable torch backend; each with whole prompts, a
chunked-prefill budget (mixed steps of decode rows and prompt chunks) and a prefix-cache hit.

Small on purpose (the real model on CPU): three prompts, 16 tokens each. One engine per path
(the compiled ones compile and warm up once, in from_config); the chunked engine of a path
shares its model."""

from __future__ import annotations

import dataclasses

import pytest
from torch._dynamo.utils import counters

from core.request import Request
from core.sampling_params import SamplingParams
from engine.attention import TorchAttentionBackend
from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.engine import LLMEngine
from tests import reference

MAX_TOKENS = 16
BLOCK_SIZE = 16
CHUNK_BUDGET = 16  # every ~37-token prompt takes three steps, next to the others' decodes
PROMPT_INDICES = (0, 1, 2)
PATHS = [(eager, backend) for eager in (True, False) for backend in ("cpu", "torch")]
PATH_IDS = [f"{'eager' if eager else 'compiled'}-{backend}" for eager, backend in PATHS]
BASE = dict(block_size=BLOCK_SIZE, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def engines():
    """``engines(path, chunked=False)`` -> the path's engine, built on first use."""
    built: dict = {}

    def get(path, chunked: bool = False) -> LLMEngine:
        if (path, chunked) not in built:
            eager, backend = path
            config = EngineConfig(enforce_eager=eager, attention_backend=backend, **BASE)
            if not chunked:
                built[path, chunked] = LLMEngine.from_config(config)
            else:
                base = get(path)
                config = dataclasses.replace(config, max_num_batched_tokens=CHUNK_BUDGET)
                built[path, chunked] = LLMEngine(config, base.runner.model, base.source)
        return built[path, chunked]

    return get


def generate(engine: LLMEngine, prompts: dict[str, list[int]]) -> dict[str, Request]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    requests = {rid: Request(rid, p, params) for rid, p in prompts.items()}
    for r in requests.values():
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats().num_used_blocks == 0
    return requests


def chat(index: int) -> list[int]:
    return reference.chat_ids(reference.PROMPTS[index])


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_engine_is_built_as_asked(engines, path):
    eager, backend = path
    engine = engines(path)
    compiled = [hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in engine.runner.model.model.layers]
    assert compiled == [not eager] * len(compiled)
    expected = {"cpu": CpuAttentionBackend, "torch": TorchAttentionBackend}[backend]
    assert type(engine.runner.backend) is expected


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prompts", "chunked"])
@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_batched_greedy_equals_hf(engines, path, chunked):
    engine = engines(path, chunked)
    counters.clear()
    prompts = {f"r{i}": chat(i) for i in PROMPT_INDICES}
    got = generate(engine, prompts)
    for rid, prompt in prompts.items():
        assert got[rid].output_token_ids == reference.hf_greedy(prompt, MAX_TOKENS), rid
    assert counters["stats"]["unique_graphs"] == 0  # compiled paths: warm-up compiled every shape


@pytest.mark.parametrize("path", PATHS, ids=PATH_IDS)
def test_prefix_cache_hit_greedy_equals_hf(engines, path):
    """The chat template's 24-token system prefix is shared: after one request finishes, the
    next one finds its first block cached and computes the rest as a chunk after cached context."""
    engine = engines(path)
    generate(engine, {"warm": chat(3)})
    prompt = chat(4)
    got = generate(engine, {"hit": prompt})["hit"]
    assert got.num_cached_tokens == BLOCK_SIZE
    assert got.output_token_ids == reference.hf_greedy(prompt, MAX_TOKENS)
