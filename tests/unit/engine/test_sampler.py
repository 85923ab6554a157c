"""The sampler against hand-computed logits: penalties, min_tokens, log-probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from core.request import FinishReason, Request
from core.sampling_params import SamplingParams
from engine.sampler import Sampler, apply_min_p

EOS = 2


def request(prompt=(5,), output=(), **params) -> Request:
    r = Request("r", list(prompt), SamplingParams(**{"temperature": 0.0, "max_tokens": 8, **params}), eos_token_id=EOS)
    r.output_token_ids = list(output)
    return r


def sample(logits: list[float], req: Request):
    return Sampler().sample(torch.tensor([logits]), [req])[0]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    #          0    1     2    3    4     5
    logits = [1.0, 3.0, -9.0, 2.9, -1.0, 2.0]
    # 1 is in the prompt: 3.0 / 2 = 1.5 loses to 3's 2.9.
    assert sample(logits, request(prompt=(1,), repetition_penalty=2.0)).token_id == 3
    # 1 in the prompt, 3 in the output: 1.5 and 1.45 both lose to 5's 2.0.
    r = request(prompt=(1,), output=(3,), repetition_penalty=2.0, logprobs=0)
    got = sample(logits, r)
    assert got.token_id == 5
    processed = torch.tensor([1.0, 1.5, -9.0, 1.45, -1.0, 2.0])
    assert got.logprob == pytest.approx(float(torch.log_softmax(processed, -1)[5]), abs=1e-6)
    # A negative logit is multiplied: -1 * 0.5 = -0.5 beats every other after a 0.25 penalty (> 1 boosts).
    r = request(prompt=(4,), repetition_penalty=0.25, logprobs=0)
    assert sample([-3.0, -2.0, -9.0, -2.0, -1.0, -2.0], r).token_id == 4


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = [0.0, 5.0, -9.0, 4.0, 0.0, 0.0]
    # Token 1 in the prompt only: no penalty.
    assert sample(logits, request(prompt=(1, 1), frequency_penalty=2.0)).token_id == 1
    # Twice in the output: 5 - 2 * 0.6 = 3.8 < 4.0.
    assert sample(logits, request(output=(1, 1), frequency_penalty=0.6)).token_id == 3
    # Once in the output with frequency 0.6: 4.4 > 4.0.
    assert sample(logits, request(output=(1,), frequency_penalty=0.6)).token_id == 1
    # Presence is counted once however often: 5 - 1.5 = 3.5 < 4.0; 3 appears 3 times: 4 - 1.5 = 2.5.
    assert sample(logits, request(output=(1, 3, 3, 3), presence_penalty=1.5)).token_id == 1
    # Both: 1 -> 5 - 0.5*2 - 0.5 = 3.5; 3 -> 4 - 0.5 - 0.5 = 3.0.
    got = sample(logits, request(output=(1, 1, 3), presence_penalty=0.5, frequency_penalty=0.5, logprobs=1))
    processed = torch.tensor([0.0, 3.5, -9.0, 3.0, 0.0, 0.0])
    assert got.token_id == 1
    assert got.top_logprobs[0] == (1, pytest.approx(float(torch.log_softmax(processed, -1)[1]), abs=1e-6))
    # A negative penalty rewards repetition.
    assert sample([0.0, 1.0, -9.0, 0.0, 0.0, 0.0], request(output=(4,), presence_penalty=-2.0)).token_id == 4


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = [0.0, 1.0, 9.0, 8.0, 0.0, 0.0]  # EOS (2) is the argmax, stop token 3 the runner-up
    r = request(output=(1,), min_tokens=2, stop_token_ids=(3,), logprobs=0)
    got = sample(logits, r)
    assert got.token_id == 1
    assert got.logprob == pytest.approx(float(torch.log_softmax(torch.tensor([0.0, 1.0, 0.0, 0.0]), -1)[1]), abs=1e-6)
    # At index 2 (== min_tokens) EOS is allowed again.
    assert sample(logits, request(output=(1, 1), min_tokens=2, stop_token_ids=(3,))).token_id == EOS
    # ignore_eos: EOS is not a stop token, so it is not masked.
    assert sample(logits, request(min_tokens=2, ignore_eos=True)).token_id == EOS


def test_min_tokens_masks_sampled_requests_too():
    logits = [-50.0, -50.0, 10.0, -50.0, -40.0, -50.0]  # all mass on EOS without the mask
    drawn = {sample(logits, request(min_tokens=1, temperature=1.0, seed=seed)).token_id for seed in range(20)}
    assert drawn == {4}
    assert sample(logits, request(min_tokens=0, temperature=1.0, seed=0)).token_id == EOS


def test_request_does_not_stop_on_eos_or_stop_token_before_min_tokens():
    r = request(min_tokens=2, stop_token_ids=(3,), max_tokens=5)
    assert r.append_output_token(EOS) is None
    assert r.append_output_token(3) is None
    assert r.append_output_token(3) is FinishReason.STOP
    r = request(min_tokens=3, max_tokens=3)
    assert [r.append_output_token(EOS) for _ in range(3)] == [None, None, FinishReason.LENGTH]


def test_logprobs_equal_log_softmax_and_top_logprobs_are_best_first():
    logits = torch.tensor([[0.5, 2.0, -1.0, 3.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    reqs = [request(logprobs=3), request(temperature=1.0, seed=3, logprobs=0)]
    a, b = Sampler().sample(logits, reqs)
    expected = torch.log_softmax(logits[0], -1)
    assert a.token_id == 3
    assert a.logprob == pytest.approx(float(expected[3]), abs=1e-6)
    assert [t for t, _ in a.top_logprobs] == [3, 1, 4]
    assert [lp for _, lp in a.top_logprobs] == pytest.approx([float(expected[i]) for i in (3, 1, 4)], abs=1e-6)
    # Sampled: temperature does not enter the logprob; 0 asks for the chosen token only.
    assert b.logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[b.token_id]), abs=1e-6)
    assert b.top_logprobs == ()
    assert math.isclose(sum(math.exp(lp) for lp in torch.log_softmax(logits[0], -1).tolist()), 1.0, rel_tol=1e-6)


def test_no_logprobs_unless_asked_and_plain_greedy_rows_untouched():
    logits = torch.tensor([[0.0, 1.0, 5.0], [3.0, 0.0, 0.5]])
    plain, penalised = Sampler().sample(logits, [request(), request(prompt=(0,), repetition_penalty=10.0)])
    assert (plain.token_id, plain.logprob, plain.top_logprobs) == (2, None, ())
    assert penalised.token_id == 2  # 3.0 / 10 = 0.3 < 0.5
    assert logits.tolist() == [[0.0, 1.0, 5.0], [3.0, 0.0, 0.5]]


def test_seeded_penalised_sampling_is_reproducible():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    params = dict(temperature=0.8, seed=11, presence_penalty=0.5, repetition_penalty=1.3)
    a = Sampler(seed=1).sample(logits[:1], [request(output=(4, 9), **params)])
    b = Sampler(seed=2).sample(logits, [request(output=(4, 9), **params), request(temperature=1.0)])
    assert a[0] == b[0]


def test_min_p_masks_a_batch_at_each_rows_temperature():
    #                       p at T=1 ~ [0.64, 0.24, 0.09, 0.03]
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 4)
    temperatures = torch.tensor([1.0, 2.0, 1.0, 0.0])
    min_ps = torch.tensor([0.3, 0.3, 0.0, 0.9])
    masked = apply_min_p(logits, temperatures, min_ps)
    inf = float("-inf")
    # Row 0: p_i / p_max = e^(l_i - 3) >= 0.3 keeps 3.0 (1) and 2.0 (0.37) only.
    # Row 1 at T=2: e^((l_i - 3) / 2) = 1, 0.61, 0.37, 0.22: 0.0's drops.
    # Row 2 (min_p 0) and row 3 (greedy) are untouched.
    assert masked.tolist() == [[3.0, 2.0, inf, inf], [3.0, 2.0, 1.0, inf], [3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]]
    assert apply_min_p(logits, temperatures, torch.zeros(4)) is logits  # no row masked: no copy


def test_min_p_sampling_never_draws_a_dropped_token_and_keeps_logprobs_unmasked():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    drawn = set()
    for seed in range(64):
        got = Sampler().sample(logits, [request(temperature=1.0, min_p=0.3, seed=seed, logprobs=0)])[0]
        drawn.add(got.token_id)
        assert got.logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[got.token_id]), abs=1e-6)
    assert drawn == {0, 1}  # both kept tokens drawn in 64 seeded draws, never 2 or 3
