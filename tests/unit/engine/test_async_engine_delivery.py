"""AsyncEngine hands each forward pass's outputs to the event loop in one wake-up: a wake-up per
output woke the loop's thread once per sequence, taking a core from the pass's OpenMP team."""

from __future__ import annotations

import asyncio
import threading

from engine.async_engine import AsyncEngine, engine_thread
from tests.unit.engine.test_step_timing import make_engine, request, tiny  # noqa: F401 (fixture)

NUM_REQUESTS, PROMPT_TOKENS, MAX_TOKENS = 3, 5, 4


def test_one_loop_wakeup_per_pass_carrying_every_sequence(tiny):  # noqa: F811
    engine = make_engine(tiny, max_num_batched_tokens=64)  # every prompt prefills in the first pass

    async def scenario():
        loop = asyncio.get_running_loop()
        batches: list[list[str]] = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def recording(callback, *args, **kwargs):
            if getattr(callback, "__name__", "") == "_put_all":
                batches.append([output.request_id for output in args[0]])
            return call_soon_threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = recording
        thread, gate = engine_thread(), threading.Event()
        thread.submit(gate.wait)  # the step loop starts once every request is in its inbox
        front = AsyncEngine(engine, thread)
        front.start()

        async def consume(rid: str) -> list[int]:
            tokens = []
            async for output in front.generate(request(rid, PROMPT_TOKENS, MAX_TOKENS, first=10 * int(rid[1:]))):
                tokens += output.new_token_ids
            return tokens

        tasks = [asyncio.create_task(consume(f"r{i}")) for i in range(NUM_REQUESTS)]
        while front._inbox.qsize() < NUM_REQUESTS:
            await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(*tasks)
        front.stop()
        return batches, results

    batches, results = asyncio.run(scenario())
    assert [len(tokens) for tokens in results] == [MAX_TOKENS] * NUM_REQUESTS
    assert [sorted(batch) for batch in batches] == [["r0", "r1", "r2"]] * MAX_TOKENS
    assert engine.scheduler.block_usage()[0] == 0  # every block back
