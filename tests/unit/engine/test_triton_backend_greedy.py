"""The real model with the Triton attention backend forced: greedy tokens equal the torch
backend's and transformers' ``generate()`` (float32). On CPU the kernels run under Triton's
interpreter (~1 s per step for 30 layers), so the prompt is short and few tokens are generated.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before engine.triton_attention imports the kernels
pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from core.request import Request  # noqa: E402
from core.sampling_params import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLMEngine  # noqa: E402
from tests import reference  # noqa: E402

MAX_TOKENS = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def generate(engine: LLMEngine, prompt_ids: list[int]) -> list[int]:
    engine.add_request(Request("r0", prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens += output.new_token_ids
    return tokens


def test_triton_greedy_equals_torch_and_hf():
    config = dict(block_size=16, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=256, device=DEVICE)
    triton_engine = LLMEngine.from_config(EngineConfig(attention_backend="triton", **config))
    assert type(triton_engine.runner.backend).__name__ == "TritonAttentionBackend"
    # Same weights, torch backend: build around the already loaded model.
    torch_config = EngineConfig(attention_backend="torch", **config)
    torch_engine = LLMEngine(torch_config, triton_engine.runner.model, triton_engine.source)
    prompt_ids = reference.tokenizer()("The capital of France is")["input_ids"]

    got = generate(triton_engine, prompt_ids)

    assert len(got) == MAX_TOKENS
    assert got == generate(torch_engine, prompt_ids)
    assert got == reference.hf_greedy(prompt_ids, MAX_TOKENS)
