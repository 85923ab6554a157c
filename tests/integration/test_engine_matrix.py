"""Every scheduling technique, alone and combined, leaves greedy output equal to the Hugging Face
reference (docs/design.md §8): static / continuous batching; prefix cache on / off (with a warm shared
prefix); a token budget that chunks every prompt / a large one; a decode cache so small that
preemption happens / an ample one; num_scheduler_steps 1 / 4 / 8; overlap on / off; colocated /
disaggregated (prefill engine → KV bytes → decode engine).

All 192 combinations run on a tiny random-weight Llama (2 layers; transformers on the same
weights is its reference); the real SmolLM2-135M-Instruct runs the plain baseline, some techniques
alone and all of them together. Prompts are the same real chat prompts for both."""

from __future__ import annotations

import pytest

from core.model_source import DEFAULT_MODEL, resolve_model
from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.model.loader import load_model
from engine.outputs import ExternalKV
from tests import reference

# Outputs run to full length (min_tokens masks EOS in Tandem, min_new_tokens in transformers), so
# the preempting cache always comes under pressure.
TINY_MAX_TOKENS = 40
REAL_MAX_TOKENS = 24
BLOCK_SIZE = 16
MAX_MODEL_LEN = 128  # the small cache: 8 blocks. Two ~42-token prompts fit; their growth to ~82 tokens does not
SYSTEM = "You are the test assistant of a serving system. Answer briefly, precisely and in plain English."


TINY_CONFIG = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, rms_norm_eps=1e-5,
    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


class Model:
    """A checkpoint folder, its transformers reference and one shared engine model."""

    def __init__(self, hf_dir, max_tokens: int):
        import torch
        from transformers import AutoModelForCausalLM

        self.hf_dir = hf_dir
        self.max_tokens = max_tokens
        self.source = resolve_model(str(hf_dir)) if hf_dir != reference.hf_dir() else resolve_model(DEFAULT_MODEL)
        self.engine_model = load_model(hf_dir, "float32", "cpu", MAX_MODEL_LEN)
        self.hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        self._engines: dict = {}
        prompts = [system_chat_ids(p) for p in reference.PROMPTS[:4]]
        self.cases = [(p, self._greedy(p)) for p in prompts]

    def _greedy(self, prompt: list[int]) -> list[int]:
        import torch

        with torch.inference_mode():
            out = self.hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   max_new_tokens=self.max_tokens, min_new_tokens=self.max_tokens, do_sample=False)
        return out[0, len(prompt):].tolist()

    def engine(self, save_kv_on_finish: bool = False, **config) -> LLMEngine:
        key = (save_kv_on_finish, tuple(sorted(config.items())))
        if key not in self._engines:
            base = dict(block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=8)
            self._engines[key] = LLMEngine(EngineConfig(**base, **config), self.engine_model, self.source, save_kv_on_finish)
        return self._engines[key]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Model:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(folder)
    return Model(folder, TINY_MAX_TOKENS)


@pytest.fixture(scope="module")
def real() -> Model:
    return Model(reference.hf_dir(), REAL_MAX_TOKENS)


def system_chat_ids(text: str) -> list[int]:
    ids = reference.tokenizer().apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}], add_generation_prompt=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def drain(e: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished_requests():
        for o in e.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens


def prefill_remotely(prefill: LLMEngine, rid: str, prompt: list[int]) -> tuple[int, ExternalKV]:
    """What a prefill worker does: first token + the prompt's blocks as bytes."""
    prefill.add_request(Request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, min_tokens=1)))
    outputs = []
    while prefill.has_unfinished_requests():
        outputs += prefill.step()
    (out,) = [o for o in outputs if o.request_id == rid]
    return out.new_token_ids[0], ExternalKV(len(prompt), out.saved_kv)


def check_combination(model: Model, policy, prefix_cache, budget, small_cache, steps, overlap, colocated) -> None:
    num_blocks = MAX_MODEL_LEN // BLOCK_SIZE if small_cache else 64
    decode = model.engine(
        scheduling_policy=policy, enable_prefix_caching=prefix_cache, max_num_batched_tokens=budget,
        num_kv_blocks=num_blocks, num_scheduler_steps=steps, enable_overlap=overlap,
    )
    tag = f"{policy}-{prefix_cache}-{budget}-{small_cache}-{steps}-{overlap}-{colocated}"
    if prefix_cache:  # warm the shared system-prompt blocks
        decode.add_request(Request(f"warm-{tag}", system_chat_ids("Hello!"), SamplingParams(temperature=0, max_tokens=2)))
        drain(decode)
    preemptions_before = decode.stats().num_preemptions
    prefill = model.engine(enable_prefix_caching=prefix_cache, max_num_batched_tokens=budget, num_kv_blocks=64,
                           save_kv_on_finish=True)
    requests = []
    for i, (prompt, _) in enumerate(model.cases):
        params = SamplingParams(temperature=0, max_tokens=model.max_tokens, min_tokens=model.max_tokens)
        request = Request(f"{tag}-{i}", prompt, params)
        external = None
        if not colocated:
            first, external = prefill_remotely(prefill, f"p-{tag}-{i}", prompt)
            request.append_output_token(first)
        decode.add_request(request, external)
        requests.append(request)
    drain(decode)
    for request, (_, expected) in zip(requests, model.cases):
        assert request.output_token_ids == expected, request.request_id
    if small_cache:
        assert decode.stats().num_preemptions > preemptions_before
    assert decode.stats().num_used_blocks == 0 and prefill.stats().num_used_blocks == 0
    if prefix_cache and colocated:
        assert requests[0].num_cached_tokens >= BLOCK_SIZE


@pytest.mark.parametrize("colocated", [True, False], ids=["colocated", "disaggregated"])
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("steps", [1, 4, 8], ids=lambda n: f"steps{n}")
@pytest.mark.parametrize("small_cache", [False, True], ids=["ample-cache", "preempting-cache"])
@pytest.mark.parametrize("budget", [512, 16], ids=["budget512", "budget16"])
@pytest.mark.parametrize("prefix_cache", [False, True], ids=["no-prefix-cache", "prefix-cache"])
@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_tiny_llama_every_combination(tiny, policy, prefix_cache, budget, small_cache, steps, overlap, colocated):
    check_combination(tiny, policy, prefix_cache, budget, small_cache, steps, overlap, colocated)


BASELINE = dict(policy="continuous", prefix_cache=False, budget=512, small_cache=False, steps=1, overlap=False,
                colocated=False)
# The real model (slow on CPU) covers the baseline, a few techniques alone and everything at once;
# the tiny model above covers every combination.
ONE_AT_A_TIME = [
    {}, {"policy": "static"}, {"prefix_cache": True}, {"colocated": True, "budget": 16},
    {"prefix_cache": True, "budget": 16, "small_cache": True, "steps": 8, "overlap": True, "colocated": True},
    {"policy": "static", "prefix_cache": True, "budget": 16, "small_cache": True, "steps": 4, "overlap": True},
]


@pytest.mark.parametrize("changes", ONE_AT_A_TIME, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()) or "baseline")
def test_real_model_each_technique_and_all_together(real, changes):
    check_combination(real, **{**BASELINE, **changes})
