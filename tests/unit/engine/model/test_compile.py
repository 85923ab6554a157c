"""compile_layers + warm_up on a tiny random Llama: the compiled forward gives the eager one's
logits, one graph serves every layer, and after warm-up no request compiles anything.

Slower than the rest of tests/unit (inductor compiles two graphs, ~10 s on 2 cores)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from core.model_source import resolve_model
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.engine import LLMEngine
from engine.model.compile import compile_layers, warm_up
from engine.model.loader import load_model
from tests.factories import engine_logits
from tests.unit.engine.model.test_loader import PROMPT, save_tiny_llama

# Inductor fuses the elementwise work between GEMMs (RMSNorm, rotary, SiLU x up) and reorders
# its float32 sums (vectorised for this machine's ISA); measured max abs difference from eager
# 5.7e-5 on logits of magnitude ~16 (~30 float32 ulps there). The bound, 2e-4, is ~1e-5 relative.
LOGITS_ATOL = 2e-4
NUM_LAYERS = 3


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(folder, eager model, compiled and warmed-up engine, graphs compiled by the warm-up)."""
    folder = tmp_path_factory.mktemp("tiny-compiled")
    save_tiny_llama(folder, num_hidden_layers=NUM_LAYERS, attention_bias=True)
    eager = load_model(folder, "float32", "cpu", 128)
    compiled = load_model(folder, "float32", "cpu", 128)
    compile_layers(compiled)
    config = EngineConfig(model=str(folder), block_size=16, num_kv_blocks=32, max_model_len=128,
                          max_num_batched_tokens=24, enforce_eager=False)
    engine = LLMEngine(config, compiled, resolve_model(str(folder)))
    counters.clear()
    took_s = warm_up(engine.runner.warm_up, (1, 2))
    assert took_s > 0
    return folder, eager, engine, counters["stats"]["unique_graphs"]


def test_warm_up_compiles_one_graph_per_shape_class_for_all_layers(models):
    """Dynamic shapes specialise 1 token apart from the rest: two graphs, however many layers
    (each layer's weights are inputs of the graph, not constants baked into one per layer)."""
    _, _, _, graphs = models
    assert graphs == 2


def test_compiled_logits_equal_eager(models):
    _, eager, engine, _ = models
    compiled = engine.runner.model
    for num_cached in (0, 17, len(PROMPT) - 1):  # prefill, chunk after cached context, decode
        expected = engine_logits(eager, PROMPT, CpuAttentionBackend(), num_cached=num_cached)
        got = engine_logits(compiled, PROMPT, CpuAttentionBackend(), num_cached=num_cached)
        torch.testing.assert_close(got, expected, atol=LOGITS_ATOL, rtol=0)


def test_compiled_engine_greedy_equals_eager_and_compiles_nothing_more(models):
    """Chunked prompts (budget 24) and decodes of three requests in one batch."""
    folder, eager, engine, _ = models
    eager_engine = LLMEngine(dataclasses.replace(engine.config, enforce_eager=True), eager,
                             resolve_model(str(folder)))
    prompts = [PROMPT, PROMPT[:5], PROMPT[3:30]]
    outputs = []
    for e in (engine, eager_engine):
        counters.clear()
        requests = [Request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                    for i, p in enumerate(prompts)]
        for r in requests:
            e.add_request(r)
        while e.has_unfinished_requests():
            e.step()
        outputs.append([r.output_token_ids for r in requests])
        assert counters["stats"]["unique_graphs"] == 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 8 for tokens in outputs[0])
