"""The prefill's first token is held until the decode worker starts the request (its ``started``
event), at most ``first_token_hold_s``: tokens 1 and 2 then reach the client one decode pass
apart. Scripted fake workers as in test_generation; a gate decides when the fake decode worker
starts, so each test says what the client has seen at that moment."""

from __future__ import annotations

import asyncio
import time

from core.request import FinishReason
from router.generation import Finished, Generation, TextDelta
from router.workers.clients import DecodeFinished, DecodeStarted, DecodeTokens
from tests.unit.router.test_generation import CLIENT_ID, FakeClients, make_generation, request

WAIT_S = 10.0  # a bound for what must happen; a test that fails stops here, not forever


class GatedStream:
    """A handed-over request's decode stream: waits at ``gate`` (``waiting`` set), then
    ``started`` and the answer after the first token, one token a message."""

    def __init__(self, answer: list[int], start: int, with_started: bool):
        self.answer, self.start, self.with_started = answer, start, with_started
        self.gate, self.waiting = asyncio.Event(), asyncio.Event()
        self.cancelled = False
        self.opened_at_s = 0.0

    async def __aiter__(self):
        self.waiting.set()
        await self.gate.wait()
        self.opened_at_s = time.monotonic()
        if self.with_started:
            yield DecodeStarted()
        for token in self.answer[self.start:]:
            yield DecodeTokens((token,))
        yield DecodeFinished(FinishReason.LENGTH, len(self.answer))

    def cancel(self) -> None:
        self.cancelled = True


class GatedClients(FakeClients):
    def __init__(self, answer: list[int], with_started: bool = True):
        super().__init__(answer)
        self.with_started = with_started
        self.streams: list[GatedStream] = []
        self.decode_called = asyncio.Event()

    def decode(self, address, request_id, request, prefill, timeout_s, output_token_ids=()):
        self.decode_calls.append((address, request_id, prefill is not None, tuple(output_token_ids)))
        start = 1 if prefill is not None else len(output_token_ids)
        self.streams.append(GatedStream(self.answer, start, self.with_started and prefill is not None))
        self.decode_called.set()
        return self.streams[-1]


async def paced_generation(tokenizer, hold_s: float, with_started: bool = True) -> tuple[Generation, GatedClients]:
    generation, fake, _, _ = await make_generation(tokenizer)
    clients = GatedClients(fake.answer, with_started)
    generation.clients, generation.first_token_hold_s = clients, hold_s
    return generation, clients


async def stream_ready(clients: GatedClients) -> GatedStream:
    """The decode stream, once the router iterates it and it waits at its gate."""
    async def ready() -> GatedStream:
        await clients.decode_called.wait()
        await clients.streams[-1].waiting.wait()
        return clients.streams[-1]

    return await asyncio.wait_for(ready(), WAIT_S)


async def test_first_token_waits_for_the_decode_workers_start(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=WAIT_S)
    events = generation.generate(CLIENT_ID, request(), time.monotonic())
    first = asyncio.ensure_future(anext(events))
    stream = await stream_ready(clients)  # the Decode call is out, its worker not started
    assert not first.done()
    stream.gate.set()
    assert (await asyncio.wait_for(first, WAIT_S)).token_ids == (clients.answer[0],)
    tokens, finished = [clients.answer[0]], None
    async for event in events:
        if isinstance(event, TextDelta):
            tokens += event.token_ids
        else:
            finished = event
    assert tokens == clients.answer  # nothing lost or repeated around the marker
    assert isinstance(finished, Finished) and finished.finish_reason is FinishReason.LENGTH
    assert clients.drop_calls == []


async def test_ttft_counts_until_the_held_token_is_sent(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=WAIT_S)
    arrival_s = time.monotonic()
    events = generation.generate(CLIENT_ID, request(), arrival_s)
    first = asyncio.ensure_future(anext(events))
    stream = await stream_ready(clients)
    stream.gate.set()
    await asyncio.wait_for(first, WAIT_S)
    finished = [event async for event in events][-1]
    assert finished.ttft_s >= stream.opened_at_s - arrival_s


async def test_a_decode_worker_that_never_starts_gets_the_token_out_after_the_hold(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=0.01)
    events = generation.generate(CLIENT_ID, request(), time.monotonic())
    first = asyncio.ensure_future(anext(events))
    stream = await stream_ready(clients)
    assert (await asyncio.wait_for(first, WAIT_S)).token_ids == (clients.answer[0],)
    assert not stream.gate.is_set()  # released by the hold's end, the worker still not started
    stream.gate.set()
    tokens = [t async for event in events if isinstance(event, TextDelta) for t in event.token_ids]
    assert [clients.answer[0], *tokens] == clients.answer


async def test_a_worker_without_the_started_event_releases_it_with_its_first_tokens(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=WAIT_S, with_started=False)
    events = generation.generate(CLIENT_ID, request(), time.monotonic())
    first = asyncio.ensure_future(anext(events))
    (await stream_ready(clients)).gate.set()
    assert (await asyncio.wait_for(first, WAIT_S)).token_ids == (clients.answer[0],)
    tokens = [t async for event in events if isinstance(event, TextDelta) for t in event.token_ids]
    assert [clients.answer[0], *tokens] == clients.answer


async def test_a_client_gone_while_the_token_is_held_cancels_the_decode_and_drops_the_manifest(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=WAIT_S)
    events = generation.generate(CLIENT_ID, request(), time.monotonic())
    first = asyncio.ensure_future(anext(events))
    stream = await stream_ready(clients)
    first.cancel()  # the client left: its task is cancelled mid-wait
    await asyncio.gather(first, return_exceptions=True)
    await events.aclose()
    assert stream.cancelled
    # The worker never answered: the manifest goes back to it, to be released there.
    assert clients.drop_calls == [("decode:0", clients.prefill_calls[0][1])]
    assert generation.metrics.registry.get_sample_value("tandem:router_requests_running") == 0


async def test_a_request_the_prefill_ends_gets_its_token_at_once(tokenizer):
    generation, clients = await paced_generation(tokenizer, hold_s=WAIT_S)
    events = [event async for event in generation.generate(CLIENT_ID, request(max_tokens=1), time.monotonic())]
    assert [e.token_ids for e in events if isinstance(e, TextDelta)] == [(clients.answer[0],)]
    assert clients.decode_calls == []
