"""``n`` > 1: one request fanned out to ``n`` sub-requests, their events merged by choice index.

Choice ``i`` runs as sub-request ``<request_id>-<i>`` (just ``<request_id>`` when ``n`` is 1); a
seeded request gives choice ``i`` the seed ``seed + i`` so that the choices differ. Choice 0 starts
first and the others once it has produced its first event: by then its prefill has written the
prompt's full blocks to the pool, so the other choices load them as a cached prefix instead of
computing them again (and a colocated decode worker finds them in its prefix cache).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from router.generation import Generation, GenerationEvent, Usage
from router.api.validation import ValidatedRequest


@dataclass(frozen=True)
class ChoiceEvent:
    index: int  # which of the n choices
    event: GenerationEvent


def choice_requests(request: ValidatedRequest) -> list[ValidatedRequest]:
    """The ``n`` sub-requests of ``request``: seeds ``seed + i`` (mod 2**64), ``n`` 1 each."""
    params = request.sampling_params
    subs = []
    for i in range(request.n):
        seed = None if params.seed is None else (params.seed + i) % 2**64
        subs.append(dataclasses.replace(request, sampling_params=dataclasses.replace(params, seed=seed), n=1))
    return subs


def total_usage(usages: Sequence[Usage]) -> Usage:
    """Usage of all choices: the prompt counted once, completion tokens summed, the best cache hit."""
    completion_tokens = sum(u.completion_tokens for u in usages)
    return Usage(usages[0].prompt_tokens, completion_tokens, max(u.cached_tokens for u in usages))


async def generate_choices(
    generation: Generation, request_id: str, request: ValidatedRequest, arrival_time_s: float
) -> AsyncIterator[ChoiceEvent]:
    """Yields every choice's events, each choice's in order, ending after the n-th Finished.

    Closing this generator (or an error in any choice) cancels every choice still running; each
    releases its own pool state.

    Raises:
        RouterError: the first error of any choice.
    """
    if request.n == 1:
        async with contextlib.aclosing(generation.generate(request_id, request, arrival_time_s)) as events:
            async for event in events:
                yield ChoiceEvent(0, event)
        return
    subs = choice_requests(request)
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

    tasks = [asyncio.create_task(pump(0))]
    try:
        num_done = 0
        while num_done < request.n:
            index, item = await queue.get()
            if len(tasks) < request.n:  # choice 0 has prefilled: start the others
                tasks += [asyncio.create_task(pump(i)) for i in range(1, request.n)]
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
