"""AsyncEngine's started marker (``generate(..., notify_start=True)``): one output with no tokens,
as the pass that admits the request begins, before its first token; callers that did not ask get
none. A decode worker sends it for a handed-over request so the router can release the prefill's
first token one pass before the second (router.generation)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from engine.async_engine import AsyncEngine, engine_thread
from tests.unit.engine.test_step_timing import make_engine, request, tiny  # noqa: F401 (fixture)

PROMPT_TOKENS, MAX_TOKENS = 5, 3


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_started_marker_before_the_first_token_only_when_asked(tiny, overlap):  # noqa: F811
    engine = make_engine(tiny, max_num_batched_tokens=64, enable_overlap=overlap)
    started_at_pass: dict[str, int] = {}  # forwards run when each request's marker went out
    num_forwards = [0]
    announce, record = engine._announce, engine._record

    def announcing(out):
        started_at_pass.update({rid: num_forwards[0] for rid in out.admitted_request_ids})
        announce(out)

    def recording(runner_output):
        num_forwards[0] += 1
        return record(runner_output)

    engine._announce, engine._record = announcing, recording

    async def scenario():
        thread, gate = engine_thread(), threading.Event()
        thread.submit(gate.wait)  # the step loop starts once both requests are in its inbox
        front = AsyncEngine(engine, thread)
        front.start()

        async def consume(rid: str, notify: bool) -> list[tuple[bool, list[int]]]:
            outputs = []
            req = request(rid, PROMPT_TOKENS, MAX_TOKENS, first=10 * int(rid[1:]))
            async for output in front.generate(req, notify_start=notify):
                outputs.append((output.started, list(output.new_token_ids)))
            return outputs

        tasks = [asyncio.create_task(consume("r0", True)), asyncio.create_task(consume("r1", False))]
        while front._inbox.qsize() < 2:
            await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*tasks)
        front.stop()
        return results, front._start_watch

    (asked, not_asked), watch = asyncio.run(scenario())
    assert asked[0] == (True, [])
    assert [started for started, _ in asked[1:]] == [False] * MAX_TOKENS
    assert sum(len(tokens) for _, tokens in asked) == MAX_TOKENS
    assert [started for started, _ in not_asked] == [False] * MAX_TOKENS
    assert started_at_pass == {"r0": 0, "r1": 0}  # announced before the first forward
    assert watch == set()
    assert engine.scheduler.block_usage()[0] == 0  # every block back
