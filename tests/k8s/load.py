"""Streamed chat completions through the official ``openai`` client against the router's NodePort,
and their tally against Hugging Face greedy (tests/reference.py): requests sent, completed, lost
(an error, or a stream that ended without ``stop``/``length``), of them explicit errors (the
cluster said so: an HTTP error status or an error event in the stream), wrong (text or token count
not equal to the reference's); and the time of every streamed token (one per content chunk)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import openai

from tests import reference

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
# reference.PROMPTS (eight) and sixteen more, all written for Tandem's tests (no data set).
PROMPTS = [*reference.PROMPTS,
           "Name three planets of the solar system.",
           "What is the boiling point of water at sea level?",
           "Write one sentence about autumn leaves.",
           "How many legs does a spider have?",
           "Give a short definition of gravity.",
           "What is a prime number?",
           "Suggest a title for a story about a lost key.",
           "Explain what a database index is for.",
           "Why do cats purr?",
           "List two uses of copper.",
           "What does HTTP stand for?",
           "Describe a rainbow to a child.",
           "What is the opposite of generous?",
           "Give me a tip for sleeping better.",
           "What language is spoken in Brazil?",
           "Write a two-line poem about coffee."]


def expected(prompt: str) -> tuple[str, int]:
    """The reference answer: HF greedy text (special tokens skipped) and its token count."""
    tokens = reference.hf_greedy(reference.chat_ids(prompt), MAX_TOKENS)
    return reference.tokenizer().decode(tokens, skip_special_tokens=True), len(tokens)


@dataclass
class Outcome:
    prompt: str
    text: str = ""
    num_tokens: int = 0
    error: str = ""  # why the request is lost; "" when it finished
    explicit: bool = False  # the error was the cluster's answer (HTTP status, SSE error event)


@dataclass
class Tally:
    sent: int
    completed: int
    lost: int  # not completed, explicit errors included
    wrong: int
    explicit_errors: int  # of the lost: the cluster answered with an error
    duration_s: float
    errors: list[str] = field(default_factory=list)  # the first few lost requests' errors

    @classmethod
    def of(cls, outcomes: list[Outcome], duration_s: float) -> Tally:
        lost = [o for o in outcomes if o.error]
        done = [o for o in outcomes if not o.error]
        wrong = [o for o in done if (o.text, o.num_tokens) != expected(o.prompt)]
        return cls(len(outcomes), len(done), len(lost), len(wrong), sum(o.explicit for o in lost), round(duration_s, 1),
                   [o.error for o in lost[:5]] + [f"wrong: {o.prompt!r} -> {o.text!r}" for o in wrong[:5]])

    def as_dict(self) -> dict:
        return asdict(self)


class Load:
    """``concurrency`` client loops streaming chat completions (temperature 0).

    Without ``continuous`` each prompt of ``prompts`` is sent once; with it the loops take the
    prompts in turn until :meth:`stop`. Use as ``async with Load(...) as load:``, then
    :meth:`wait_for` a state, act, :meth:`stop`, and :meth:`finish`.
    """

    def __init__(self, url: str, concurrency: int, prompts: list[str] = PROMPTS, continuous: bool = False,
                 timeout_s: float = 300.0):
        self.url, self.concurrency, self.prompts, self.continuous = url, concurrency, prompts, continuous
        self.timeout_s = timeout_s
        self.outcomes: list[Outcome] = []
        self.first_tokens = 0  # requests that received their first token
        self.token_times_s: list[float] = []  # each content chunk's arrival, seconds after the start (now_s)
        self.changed = asyncio.Event()
        self._next = 0
        self._stopped = False
        self._loops: list[asyncio.Task] = []
        self._client: openai.AsyncOpenAI | None = None
        self._started_s = 0.0

    async def __aenter__(self) -> Load:
        # max_retries=0: a request the cluster fails is lost, never resent by the client.
        self._client = openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0,
                                          timeout=self.timeout_s)
        self._started_s = time.monotonic()
        self._loops = [asyncio.create_task(self._loop()) for _ in range(self.concurrency)]
        return self

    async def __aexit__(self, *exc) -> None:
        self._stopped = True
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        await self._client.close()

    def now_s(self) -> float:
        """Seconds since the load started (the clock of ``token_times_s``)."""
        return time.monotonic() - self._started_s

    def stop(self) -> None:
        """No new request after this; the ones in flight go on."""
        self._stopped = True

    async def finish(self) -> Tally:
        """Waits for every request in flight (the loops end after :meth:`stop`, or when a
        one-shot list is done) and tallies them all."""
        await asyncio.wait_for(asyncio.gather(*self._loops), timeout=self.timeout_s * 2)
        return Tally.of(self.outcomes, time.monotonic() - self._started_s)

    async def wait_for(self, condition: Callable[[], bool], message: str, timeout_s: float = 300.0) -> None:
        """Re-checks ``condition`` (run in a thread: it may call kubectl) at each client-side
        progress, or every second. Raises AssertionError naming ``message`` on timeout."""
        deadline = time.monotonic() + timeout_s
        while not await asyncio.to_thread(condition):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {message}")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=1.0)
            except TimeoutError:
                pass

    async def _loop(self) -> None:
        while not self._stopped:
            i = self._next
            if not self.continuous and i >= len(self.prompts):
                return
            self._next += 1
            self.outcomes.append(await self._one(self.prompts[i % len(self.prompts)]))
            self.changed.set()

    async def _one(self, prompt: str) -> Outcome:
        outcome, finish, usage = Outcome(prompt), None, None
        try:
            stream = await self._client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta.content:
                        self.token_times_s.append(self.now_s())
                        if not outcome.text:
                            self.first_tokens += 1
                            self.changed.set()
                        outcome.text += choice.delta.content
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
        except openai.OpenAIError as err:
            outcome.error = f"{type(err).__name__}: {err}"[:300]
            # APIStatusError (an HTTP status) and a stream's error event are APIErrors; a broken
            # or timed-out connection is an APIConnectionError: nobody told the client
            outcome.explicit = isinstance(err, openai.APIError) and not isinstance(err, openai.APIConnectionError)
            return outcome
        if finish not in ("stop", "length") or usage is None:
            outcome.error = f"stream ended with finish_reason {finish!r}"
        else:
            outcome.num_tokens = usage.completion_tokens
        return outcome
