"""Several prompts, ``n`` > 1 or ``best_of``: one request fanned out to sub-requests, their events
merged by candidate index.

Prompt ``i``'s candidate ``j`` (``best_of`` of them, ``n`` when not set) has the index
``i * best_of + j`` (OpenAI's choice index when ``best_of`` is ``n``) and runs as sub-request
``<request_id>-<index>`` (just ``<request_id>`` for a single candidate); a seeded request gives
candidate ``j`` the seed ``seed + j`` so that a prompt's candidates differ. Each prompt's candidate
0 starts first and its others once it has produced its first event: by then its prefill has
written the prompt's full blocks to the pool, so the other candidates load them as a cached prefix
instead of computing them again (and a colocated decode worker finds them in its prefix cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from router.generation import Generation, GenerationEvent, Usage
from router.api.validation import ValidatedRequest

T = TypeVar("T")


@dataclass(frozen=True)
class ChoiceEvent:
    index: int  # which of the n choices
    event: GenerationEvent


def choice_requests(request: ValidatedRequest) -> list[ValidatedRequest]:
    """The ``best_of`` (or ``n``) candidate sub-requests of ``request``: seeds ``seed + j``
    (mod 2**64), one choice each."""
    params = request.sampling_params
    subs = []
    for j in range(request.num_candidates):
        seed = None if params.seed is None else (params.seed + j) % 2**64
        subs.append(dataclasses.replace(request, sampling_params=dataclasses.replace(params, seed=seed), n=1,
                                        best_of=None))
    return subs


def total_usage(usages: Sequence[Usage], per_prompt: int | None = None) -> Usage:
    """Usage of all candidates (in index order, ``per_prompt`` of each prompt; None: all of one
    prompt): each prompt counted once with its best cache hit, completion tokens summed (every
    candidate's, also those ``best_of`` drops: they were generated)."""
    per_prompt = per_prompt or len(usages)
    groups = [usages[i : i + per_prompt] for i in range(0, len(usages), per_prompt)]
    return Usage(sum(g[0].prompt_tokens for g in groups), sum(u.completion_tokens for u in usages),
                 sum(max(u.cached_tokens for u in g) for g in groups))


def best_candidates(candidates: Sequence[T], per_prompt: int, n: int, cumulative_logprob) -> list[tuple[int, T]]:
    """``best_of``: of each prompt's ``per_prompt`` candidates (in index order), the ``n`` of
    highest ``cumulative_logprob(candidate)``, best first, as (choice index ``i * n + rank``,
    candidate); ties keep the lower candidate index first."""
    chosen = []
    for first in range(0, len(candidates), per_prompt):
        group = sorted(candidates[first : first + per_prompt], key=cumulative_logprob, reverse=True)  # stable
        chosen += [(first // per_prompt * n + rank, c) for rank, c in enumerate(group[:n])]
    return chosen


async def generate_choices(
    generation: Generation, request_id: str, requests: Sequence[ValidatedRequest], arrival_time_s: float
) -> AsyncIterator[ChoiceEvent]:
    """Yields every candidate's events of every prompt (``requests``, one per prompt, all with
    the same ``num_candidates``), each candidate's in order, ending after the last Finished.

    Closing this generator (or an error in any candidate) cancels every one still running; each
    releases its own pool state.

    Raises:
        RouterError: the first error of any candidate.
    """
    if len(requests) == 1 and requests[0].num_candidates == 1:
        async with contextlib.aclosing(generation.generate(request_id, requests[0], arrival_time_s)) as events:
            async for event in events:
                yield ChoiceEvent(0, event)
        return
    per_prompt = requests[0].num_candidates
    subs = [sub for request in requests for sub in choice_requests(request)]
    queue: asyncio.Queue[tuple[int, GenerationEvent | Exception | None]] = asyncio.Queue()

    async def pump(index: int) -> None:
        try:
            events = generation.generate(f"{request_id}-{index}", subs[index], arrival_time_s)
            async with contextlib.aclosing(events):
                async for event in events:
                    queue.put_nowait((index, event))
        except Exception as err:  # handed to the consumer, which raises it
            queue.put_nowait((index, err))
            return
        queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(first)) for first in range(0, len(subs), per_prompt)]
    started = set()  # prompts whose other candidates run
    try:
        num_done = 0
        while num_done < len(subs):
            index, item = await queue.get()
            prompt = index // per_prompt
            if prompt not in started:  # the prompt's candidate 0 has prefilled: start the others
                started.add(prompt)
                first = prompt * per_prompt
                tasks += [asyncio.create_task(pump(i)) for i in range(first + 1, first + per_prompt)]
            if isinstance(item, Exception):
                raise item
            if item is None:
                num_done += 1
                continue
            yield ChoiceEvent(index, item)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
