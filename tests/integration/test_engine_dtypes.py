"""bfloat16 and float16 engines against transformers in the same dtype, real model, on CPU.

Half precision cannot promise float32's token-for-token equality (docs/design.md §8 is a float32
claim): the engine and transformers round at different places (fused QKV / gate-up GEMMs, the
attention kernels, inductor's fusions), and SmolLM2's bf16 logits have exact ties. What holds,
measured on this repository's eight prompts, 16 greedy tokens each, and asserted below:

================================================  ==================  ==================
                                                  bfloat16            float16
================================================  ==================  ==================
logits, max abs difference engine vs HF same      1.52 (bound 3.0)    0.156 (bound 0.3)
dtype (teacher-forced on HF's greedy sequence,
every position; logits of magnitude ~10-30)
mean abs error vs the fp32 reference, engine /    0.159 / 0.182       0.0187 / 0.0202
HF same dtype (bound: engine <= 1.25 x HF)
argmax equals HF's where HF's top-2 gap > 2 ulps  3 of ~460 differ,   0 differ
(bf16 0.25, fp16 0.03 at logits 16-32)            all at gaps <=0.125
greedy engine (default: compiled, CPU backend,    first token 8/8;    all 16: 8/8
batch of 8) == HF generate                        all 16: 4/8         (bound >= 7/8)
                                                  (bound >= 3/8)
================================================  ==================  ==================

bfloat16 engines run their GEMMs through whichever backend the linear chooser measured fastest
(oneDNN's bfloat16 inner product, Tandem's kernel with the bf16 weight widened to float32, or
F.linear; engine.model.linear_chooser) and decode attention
through the C kernel's bfloat16-K/V entry point (float32 accumulation). float16 runs F.linear and
gather + SDPA (asserted); it is fast on a CPU with AVX512-FP16, and transformers' fp16 reference
is the slow part.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from core.request import Request
from core.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.cpu_attention import CpuAttentionBackend
from engine.engine import LLMEngine
from engine.model.linear import Linear
from engine.model.loader import TORCH_DTYPES, load_model
from tests import reference
from tests.factories import engine_logits

MAX_TOKENS = 16


@dataclass(frozen=True)
class Bounds:
    max_abs_logits: float  # engine vs HF in the same dtype
    error_ratio: float  # engine's mean abs error vs fp32 over HF's own
    argmax_gap: float  # top-2 gaps of HF above which the argmax must agree
    min_full_matches: int  # prompts (of 8) whose MAX_TOKENS greedy tokens all equal HF's


BOUNDS = {
    "bfloat16": Bounds(max_abs_logits=3.0, error_ratio=1.25, argmax_gap=0.25, min_full_matches=3),
    "float16": Bounds(max_abs_logits=0.3, error_ratio=1.25, argmax_gap=0.03, min_full_matches=7),
}


@dataclass
class Case:
    dtype: str
    prompts: list[list[int]]
    hf_tokens: list[list[int]]  # HF generate, greedy, in this dtype
    hf_logits: list[torch.Tensor]  # [len(prompt + hf_tokens), vocab], float32 copies, this dtype
    fp32_logits: list[torch.Tensor]  # the same sequences through the fp32 reference


@pytest.fixture(scope="module", params=list(BOUNDS))
def case(request) -> Case:
    from transformers import AutoModelForCausalLM

    dtype = TORCH_DTYPES[request.param]
    hf = AutoModelForCausalLM.from_pretrained(reference.hf_dir(), dtype=dtype).eval()
    prompts = [reference.chat_ids(p) for p in reference.PROMPTS]
    hf_tokens, hf_logits, fp32_logits = [], [], []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=MAX_TOKENS, do_sample=False)
            hf_tokens.append(out[0, len(p):].tolist())
            sequence = torch.tensor([p + hf_tokens[-1]])
            hf_logits.append(hf(sequence).logits[0].float())
            fp32_logits.append(reference.hf_model()(sequence).logits[0])
    return Case(request.param, prompts, hf_tokens, hf_logits, fp32_logits)


@pytest.fixture(scope="module")
def engine_teacher_forced(case) -> list[torch.Tensor]:
    """The engine model's (eager, CPU backend) logits over the same sequences, one prefill each."""
    model = load_model(reference.hf_dir(), case.dtype, "cpu", 256)
    allowed = {"bfloat16": {"onednn", "fp32_cpu", "torch"}, "float16": {"torch"}}[case.dtype]
    assert {m.backend_for(n) for m in model.modules() if isinstance(m, Linear) for n in (1, 16)} <= allowed
    backend = CpuAttentionBackend()
    return [engine_logits(model, p + t, backend) for p, t in zip(case.prompts, case.hf_tokens)]


def test_logits_close_to_hf_in_the_same_dtype(case, engine_teacher_forced):
    bounds = BOUNDS[case.dtype]
    worst = max((e - h).abs().max().item() for e, h in zip(engine_teacher_forced, case.hf_logits))
    assert worst <= bounds.max_abs_logits


def test_engine_is_as_accurate_as_hf_in_the_same_dtype(case, engine_teacher_forced):
    """Distance to the float32 reference: the engine's rounding is no worse than transformers'."""
    ours = torch.cat([(e - r).abs().flatten() for e, r in zip(engine_teacher_forced, case.fp32_logits)]).mean()
    theirs = torch.cat([(h - r).abs().flatten() for h, r in zip(case.hf_logits, case.fp32_logits)]).mean()
    assert ours <= BOUNDS[case.dtype].error_ratio * theirs


def test_argmax_equals_hf_wherever_hf_is_not_near_a_tie(case, engine_teacher_forced):
    gap = BOUNDS[case.dtype].argmax_gap
    num_checked = 0
    for e, h in zip(engine_teacher_forced, case.hf_logits):
        top2 = h.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > gap
        assert torch.equal(e.argmax(-1)[clear], h.argmax(-1)[clear])
        num_checked += int(clear.sum())
    # The gap excludes only near-ties, so most positions are checked: how many HF's own logits
    # leave clear depends on the CPU's bf16/fp16 arithmetic (an AVX2-only AMD EPYC: 359 of 411 in
    # bfloat16, 87 %; an Intel with AMX: over 90 %).
    assert num_checked > 0.8 * sum(len(h) for h in case.hf_logits)


def test_greedy_tokens_of_the_default_engine(case):
    """The engine as ``tandem up --dtype`` runs it: compiled, attention_backend auto (CPU)."""
    engine = LLMEngine.from_config(EngineConfig(dtype=case.dtype, block_size=16, num_kv_blocks=128, max_model_len=256))
    assert engine.runner.kv_cache.dtype == TORCH_DTYPES[case.dtype]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    requests = [Request(f"r{i}", p, params) for i, p in enumerate(case.prompts)]
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        engine.step()
    assert [r.output_token_ids[:1] for r in requests] == [t[:1] for t in case.hf_tokens]
    full = sum(r.output_token_ids == t for r, t in zip(requests, case.hf_tokens))
    assert full >= BOUNDS[case.dtype].min_full_matches, f"{full} of {len(requests)} prompts"
