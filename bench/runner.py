"""Drives a workload through the client on an arrival schedule, with a progress bar."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.arrivals import ArrivalConfig, send_times_s
from bench.client import ClientConfig, RequestRecord, send
from bench.workloads import BenchRequest


@dataclass
class RunResult:
    records: list[RequestRecord]  # in workload order
    duration_s: float  # from the run's start to the last request's end


async def run(requests: list[BenchRequest], arrivals: ArrivalConfig, client: ClientConfig, *,
              show_progress: bool = True, label: str = "bench") -> RunResult:
    """Sends ``requests`` as ``arrivals`` says; returns when every sent request has ended."""
    times = send_times_s(arrivals, [r.arrival_s for r in requests])
    num_to_send = len(requests) if times is None else len(times)
    slots = arrivals.concurrency if arrivals.mode == "concurrency" else arrivals.max_in_flight
    limiter = asyncio.Semaphore(slots) if slots else contextlib.nullcontext()
    limits = httpx.Limits(max_connections=max(slots, 1) if slots else None, max_keepalive_connections=None)
    progress = Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[errors]} errors"),
                        TimeElapsedColumn(), disable=not show_progress)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=client.timeout_s) as http:
        with progress:
            task = progress.add_task(label, total=num_to_send, errors=0)
            start = time.perf_counter()

            async def one(index: int) -> None:
                async with limiter:
                    if arrivals.duration_s and time.perf_counter() - start > arrivals.duration_s:
                        return  # concurrency mode: the duration cap stops new sends
                    record = await send(http, client, requests[index], index, start)
                records.append(record)
                progress.update(task, advance=1, errors=sum(not r.ok for r in records))

            tasks = []
            for index in range(num_to_send):
                if times is not None:
                    await asyncio.sleep(max(0.0, start + times[index] - time.perf_counter()))
                tasks.append(asyncio.create_task(one(index)))
            await asyncio.gather(*tasks)
    duration_s = max((r.start_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    return RunResult(sorted(records, key=lambda r: r.index), duration_s)
