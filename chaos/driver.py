"""Sends a workload as streaming OpenAI requests and classifies how each one ended.

Closed loop: ``concurrency`` requests in flight, the next sent as one ends; a burst adds requests
at once. Every received token is counted and time-stamped (fault triggers at a token count,
throughput recovery). A request may carry a disconnect plan: the client goes away at a stage
(before the first token, right after it while the decode worker loads the KV, or mid-decode).

Outcomes (:data:`OUTCOMES`):

- ``completed``: a finish reason arrived and no error;
- ``error``: an explicit error: an HTTP error status with a body, an SSE ``error`` event, or a
  connection the router refused (the client knows at once and may retry);
- ``lost``: no end by ``deadline_s``, or a stream that ended without a finish reason or error;
- ``cancelled``: the client itself went away (a planned disconnect or abort).

``wrong`` is decided later, against the reference text (chaos.campaign).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from bench.client import ClientConfig, request_body
from bench.workloads import BenchRequest

OUTCOMES = ("completed", "error", "lost", "cancelled")


@dataclass
class Outcome:
    index: int  # this request's number in the run
    workload_index: int  # which workload request it sent (a burst reuses them)
    start_s: float  # seconds after the run started
    end_s: float = 0.0
    status: str = "lost"
    text: str = ""
    finish_reason: str = ""
    error: str = ""
    num_tokens: int = 0  # content chunks received
    disconnect_stage: str = ""  # the planned client disconnect, if any


@dataclass
class Progress:
    """Tokens received so far, all requests together (fault triggers wait on ``changed``)."""

    start_s: float = field(default_factory=time.monotonic)
    num_tokens: int = 0
    token_times_s: list[float] = field(default_factory=list)  # seconds after start_s
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def add(self, num_tokens: int) -> None:
        self.num_tokens += num_tokens
        self.token_times_s.append(time.monotonic() - self.start_s)
        self.changed.set()

    def now_s(self) -> float:
        return time.monotonic() - self.start_s


@dataclass
class DisconnectPlan:
    stage: str
    fraction: float
    until_s: float  # plans apply to requests started before this (run seconds)


class Driver:
    """One run of ``requests`` against ``client.url``; see the module docstring."""

    def __init__(self, requests: list[BenchRequest], client: ClientConfig, concurrency: int, deadline_s: float,
                 seed: int, duration_s: float = 0.0, rate_per_s: float = 0.0):
        """``duration_s`` > 0: keep sending (cycling ``requests``) until then; else each once.
        ``rate_per_s`` > 0: an open loop instead of ``concurrency`` in flight: requests start at
        Poisson arrival times of that rate (seeded), however many are in flight."""
        self.requests, self.client, self.concurrency, self.deadline_s = requests, client, concurrency, deadline_s
        self.duration_s, self.rate_per_s = duration_s, rate_per_s
        self.rng = random.Random(seed)
        self.progress = Progress()
        self.outcomes: list[Outcome] = []
        self.disconnect: DisconnectPlan | None = None
        self._tasks: dict[int, asyncio.Task] = {}  # in flight, by outcome index
        self._aborted: set[int] = set()
        self._next = 0  # next workload request of the closed loop
        self._http: httpx.AsyncClient | None = None

    async def run(self) -> list[Outcome]:
        """Sends every workload request (and any burst); returns when all have ended."""
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(limits=limits, timeout=self.deadline_s) as self._http:
            workers = [asyncio.create_task(self._open_loop())] if self.rate_per_s > 0 else [
                asyncio.create_task(self._loop()) for _ in range(self.concurrency)]
            await asyncio.gather(*workers)
            while self._tasks:  # burst requests still running
                await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
        return sorted(self.outcomes, key=lambda o: o.index)

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks)

    async def _loop(self) -> None:
        while (self.progress.now_s() < self.duration_s) if self.duration_s else self._next < len(self.requests):
            index = self._next % len(self.requests)
            self._next += 1
            await self._start(index)

    async def _open_loop(self) -> None:
        next_s = 0.0
        while (next_s < self.duration_s) if self.duration_s else self._next < len(self.requests):
            await asyncio.sleep(max(0.0, next_s - self.progress.now_s()))
            self._start(self._next % len(self.requests))
            self._next += 1
            next_s += self.rng.expovariate(self.rate_per_s)
        if self.duration_s:  # the window lasts its duration even when the next arrival falls past it
            await asyncio.sleep(max(0.0, self.duration_s - self.progress.now_s()))

    def _start(self, workload_index: int) -> asyncio.Task:
        outcome = Outcome(len(self.outcomes), workload_index, self.progress.now_s())
        plan = self.disconnect
        if plan is not None and outcome.start_s < plan.until_s and self.rng.random() < plan.fraction:
            outcome.disconnect_stage = plan.stage
        self.outcomes.append(outcome)
        task = asyncio.create_task(self._one(outcome))
        self._tasks[outcome.index] = task
        task.add_done_callback(lambda _: self._tasks.pop(outcome.index, None))
        return task

    def burst(self, num_requests: int) -> None:
        """Sends ``num_requests`` more at once (workload requests chosen by the seeded RNG)."""
        for _ in range(num_requests):
            self._start(self.rng.randrange(len(self.requests)))

    async def abort_storm(self, fraction: float, within_s: float = 1.0) -> int:
        """Cancels ``fraction`` of the requests in flight, each at a random moment within
        ``within_s``. Returns how many it cancelled."""
        victims = [i for i in sorted(self._tasks) if self.rng.random() < fraction]
        delays = sorted((self.rng.uniform(0, within_s), i) for i in victims)
        start = time.monotonic()
        for delay_s, index in delays:
            await asyncio.sleep(max(0.0, start + delay_s - time.monotonic()))
            task = self._tasks.get(index)
            if task is not None:
                self._aborted.add(index)
                task.cancel()
        return len(victims)

    async def _one(self, outcome: Outcome) -> None:
        try:
            await asyncio.wait_for(self._stream(outcome), timeout=self.deadline_s)
        except asyncio.TimeoutError:
            outcome.status, outcome.error = "lost", f"no end within the {self.deadline_s:g} s deadline"
        except asyncio.CancelledError:
            if outcome.index not in self._aborted:
                raise
            outcome.status = "cancelled"
        outcome.end_s = self.progress.now_s()
        self.progress.changed.set()  # a token-count trigger re-checks (and sees the run end)

    async def _stream(self, outcome: Outcome) -> None:
        path, body = request_body(self.requests[outcome.workload_index], self.client)
        stage = outcome.disconnect_stage
        try:
            async with self._http.stream("POST", self.client.url.rstrip("/") + path, json=body) as response:
                if response.status_code != 200:
                    outcome.status = "error"
                    outcome.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')[:300]}"
                    return
                if stage == "before_first_token":
                    outcome.status = "cancelled"
                    return  # leaving the block closes the connection: the router sees a disconnect
                async for line in response.aiter_lines():
                    if self._on_line(outcome, line):
                        return
                    if (stage == "mid_transfer" and outcome.num_tokens >= 1) or (
                            stage == "mid_decode" and outcome.num_tokens >= 4):
                        outcome.status = "cancelled"
                        return
        except httpx.ConnectError as err:
            outcome.status, outcome.error = "error", f"connection refused: {err}"
            return
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as err:
            outcome.status, outcome.error = "lost", f"{type(err).__name__}: {err}"
            return
        if outcome.status != "cancelled":
            outcome.status = "lost"
            outcome.error = outcome.error or "stream ended without a finish_reason"

    def _on_line(self, outcome: Outcome, line: str) -> bool:
        """Folds one SSE line into ``outcome`` (mutates it and the progress); True at its end."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        if data == "[DONE]":
            if outcome.status != "error" and outcome.finish_reason == "abort":
                outcome.status, outcome.error = "error", "finish_reason abort"
            elif outcome.status != "error":
                outcome.status = "completed" if outcome.finish_reason else "lost"
            return True
        payload = json.loads(data)
        if "error" in payload:
            outcome.status, outcome.error = "error", json.dumps(payload["error"])[:300]
            return False  # [DONE] follows
        for choice in payload.get("choices") or []:
            text = choice.get("text")
            if text is None:
                text = (choice.get("delta") or {}).get("content")
            if text:
                outcome.text += text
                outcome.num_tokens += 1
                self.progress.add(1)
            outcome.finish_reason = choice.get("finish_reason") or outcome.finish_reason
        return False
