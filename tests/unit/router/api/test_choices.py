"""n > 1 fan-out: sub-request ids and seeds, choice 0 first, errors cancel the rest."""

from __future__ import annotations

import asyncio

import pytest

from core.request import FinishReason
from core.sampling_params import SamplingParams
from router.api.choices import best_candidates, choice_requests, generate_choices, total_usage
from router.errors import ErrorKind, RouterError
from router.generation import Finished, TextDelta, Usage
from router.api.validation import ValidatedRequest


class FakeGeneration:
    """Each sub-request yields its id as text, then Finished; ``fail`` names one that raises."""

    def __init__(self, fail: str | None = None):
        self.fail = fail
        self.started: list[str] = []
        self.closed: list[str] = []
        self.first_done = asyncio.Event()

    async def generate(self, request_id, request, arrival_time_s):
        self.started.append(request_id)
        try:
            if request_id != self.started[0]:
                assert self.first_done.is_set(), "a choice started before choice 0 prefilled"
            yield TextDelta(f"{request_id}:{request.sampling_params.seed}", (1,))
            self.first_done.set()
            await asyncio.sleep(0)
            if request_id == self.fail:
                raise RouterError("decode worker failed", ErrorKind.UNAVAILABLE)
            yield Finished(FinishReason.STOP, Usage(7, 2, 4 if request_id.endswith("-0") else 6), 0.1)
        finally:
            self.closed.append(request_id)


def request(n: int, seed: int | None = 10) -> ValidatedRequest:
    return ValidatedRequest([1, 2, 3], SamplingParams(seed=seed), (), n)


async def collect(gen: FakeGeneration, n: int, seed: int | None = 10) -> list:
    return [(c.index, c.event) async for c in generate_choices(gen, "cmpl-x", [request(n, seed)], 0.0)]


def test_choice_requests_offset_seeds_and_keep_unseeded() -> None:
    assert [r.sampling_params.seed for r in choice_requests(request(3, seed=2**64 - 2))] == [2**64 - 2, 2**64 - 1, 0]
    assert [r.sampling_params.seed for r in choice_requests(request(2, seed=None))] == [None, None]
    assert {r.n for r in choice_requests(request(3))} == {1}


def test_usage_counts_the_prompt_once() -> None:
    assert total_usage([Usage(7, 2, 4), Usage(7, 5, 6)]) == Usage(7, 7, 6)


async def test_n_choices_run_as_sub_requests_after_choice_0() -> None:
    gen = FakeGeneration()
    events = await collect(gen, 3)
    assert gen.started[0] == "cmpl-x-0" and sorted(gen.started) == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2"]
    texts = {i: e.text for i, e in events if isinstance(e, TextDelta)}
    assert texts == {0: "cmpl-x-0:10", 1: "cmpl-x-1:11", 2: "cmpl-x-2:12"}
    assert sorted(i for i, e in events if isinstance(e, Finished)) == [0, 1, 2]


async def test_n_1_keeps_the_request_id() -> None:
    gen = FakeGeneration()
    assert [i for i, _ in await collect(gen, 1)] == [0, 0]
    assert gen.started == ["cmpl-x"]


async def test_an_error_in_one_choice_cancels_the_others() -> None:
    gen = FakeGeneration(fail="cmpl-x-1")
    with pytest.raises(RouterError, match="decode worker failed"):
        await collect(gen, 3)
    assert sorted(gen.closed) == sorted(gen.started)


async def test_several_prompts_each_start_their_candidate_0_and_index_prompt_major() -> None:
    gen = FakeGeneration()
    gen.first_done.set()  # every prompt's candidate 0 starts at once; each prompt's others after it
    subs = [ValidatedRequest([1], SamplingParams(seed=10), (), 2), ValidatedRequest([2], SamplingParams(seed=10), (), 2)]
    events = [(c.index, c.event) async for c in generate_choices(gen, "cmpl-x", subs, 0.0)]
    assert gen.started[:2] == ["cmpl-x-0", "cmpl-x-2"]
    texts = {i: e.text for i, e in events if isinstance(e, TextDelta)}
    assert texts == {0: "cmpl-x-0:10", 1: "cmpl-x-1:11", 2: "cmpl-x-2:10", 3: "cmpl-x-3:11"}
    usages = [Usage(7, 2, 4), Usage(7, 5, 6), Usage(3, 1, 0), Usage(3, 1, 2)]
    assert total_usage(usages, per_prompt=2) == Usage(10, 9, 8)


def test_best_candidates_keeps_the_n_best_of_each_prompt_best_first() -> None:
    scores = [-3.0, -1.0, -2.0, -0.5, -0.5, -9.0]  # two prompts of 3 candidates
    chosen = best_candidates(list(range(6)), per_prompt=3, n=2, cumulative_logprob=scores.__getitem__)
    assert chosen == [(0, 1), (1, 2), (2, 3), (3, 4)]  # a tie keeps the lower candidate first
