"""Runs a campaign's scenarios one after another on one local cluster and measures each.

Per scenario: the workload is replayed while its faults fire; ``tandem up``'s supervision runs
all along (killed services come back). Then every stopped process is resumed, the cluster must be
whole again (every service up and registered with the router), and workers and pool must be idle
within ``idle_bound_s``: what is still held then is **leaked**. Greedy answers are compared with
the Hugging Face reference (**wrong**). Throughput recovery (chaos.recovery): the first moment
after the last fault ended when the token rate over a window is back to half the rate before the
first fault, and when it is back to that rate itself (within the baseline's noise).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.client import ClientConfig
from bench.workloads import BenchRequest
from chaos.cpu_meter import CpuMeter
from chaos.driver import Driver, Outcome, Progress
from chaos.faults import FaultContext, FaultLog, resume_stopped, run_fault, supervise
from chaos.link_proxy import LinkProxies
from chaos.probe import ClusterProbe, wait_idle
from chaos.recovery import (AFTER_HEAL_S, BASELINE_FRACTION, HALF_FRACTION, WINDOW_S, Recovery, recovery,
                            tokens_each_s)
from chaos.reference import reference_key
from chaos.sampler import Sample, Sampler, summary
from chaos.schedule import Campaign, Scenario
from launcher.local_cluster import LocalCluster

SUPERVISE_INTERVAL_S = 0.5
WHOLE_TIMEOUT_S = 120.0


@dataclass
class ScenarioResult:
    name: str
    faults: list[FaultLog]
    counts: dict[str, int]  # sent, completed, retried, error, lost, wrong, cancelled
    leaked: dict[str, int]  # service.field -> count still held after idle_bound_s (empty: none)
    idle_after_s: float | None  # how long until idle once the run ended (None: never within the bound)
    rss_growth_bytes: int
    recovery: Recovery  # the baseline before the faults and how soon the rate was back after them
    duration_s: float
    examples: dict[str, list[str]] = field(default_factory=dict)  # a few errors / lost, by status
    supervision: list[str] = field(default_factory=list)  # what tandem up's supervision did
    samples: list[Sample] = field(default_factory=list)  # gauges over time (campaign sample_every_s > 0)
    offered_rate_per_s: float = 0.0  # the open loop's arrival rate (0: closed loop)
    # Seconds from a link fault's start until a router marked its worker down (None: no link
    # fault, or never marked down)
    detect_s: float | None = None
    tokens_each_s: list[int] = field(default_factory=list)  # tokens received in each second of the run
    # the machine's other jobs' CPU (chaos.cpu_meter): (run seconds at an interval's end, cores over it)
    other_cores: list[tuple[float, float]] = field(default_factory=list)

    @property
    def completion_rate_per_s(self) -> float:
        """Completed requests per second of the run: its throughput (a capacity when saturated)."""
        return self.counts["completed"] / self.duration_s if self.duration_s > 0 else 0.0


def detect_s(router_logs: list[Path], needles: tuple[str, ...], started_at: float) -> float | None:
    """Seconds from ``started_at`` (wall clock) until the first router log line (JSON lines with
    ``ts``) after it that holds every one of ``needles``; None: none does."""
    first = None
    for path in router_logs:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if not all(needle in line for needle in needles):
                continue
            try:
                ts = json.loads(line)["ts"]
            except (ValueError, KeyError):
                continue
            if ts >= started_at and (first is None or ts < first):
                first = ts
    return None if first is None else first - started_at


def recovery_of(progress: Progress, faults: list[FaultLog], other_cores: list[tuple[float, float]] = ()) -> Recovery:
    """The throughput recovery (chaos.recovery) from the first fault's start to the last one's end."""
    if not faults:
        return recovery(progress.token_times_s, None, None)
    return recovery(progress.token_times_s, min(f.start_s for f in faults), max(f.end_s for f in faults), other_cores)


def count(outcomes: list[Outcome], requests: list[BenchRequest], refs: dict[str, str] | None) -> dict[str, int]:
    counts = {"sent": len(outcomes), "completed": 0, "retried": 0, "error": 0, "lost": 0, "wrong": 0, "cancelled": 0}
    for o in outcomes:
        counts[o.status] += 1
        counts["retried"] += o.retried
        if o.status == "completed" and refs is not None and o.text != refs[reference_key(requests[o.workload_index])]:
            counts["wrong"] += 1
    return counts


def _examples(outcomes: list[Outcome]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for o in outcomes:
        if o.status in ("error", "lost") and len(out.setdefault(o.status, [])) < 3:
            out[o.status].append(f"#{o.index} at {o.start_s:.1f} s: {o.error}")
    return out


class CampaignRunner:
    """Runs scenarios on ``cluster`` (started, healthy); methods run in one event loop on the
    thread that started the cluster (supervision forks from it)."""

    def __init__(self, cluster: LocalCluster, campaign: Campaign, requests: list[BenchRequest],
                 client: ClientConfig, refs: dict[str, str] | None, fault_file: str, expected_workers: dict[str, int],
                 links: LinkProxies | None = None):
        self.cluster, self.campaign, self.requests, self.client = cluster, campaign, requests, client
        self.refs, self.fault_file, self.expected_workers = refs, fault_file, expected_workers
        self.links = links

    async def run(self, scenario: Scenario, seed: int, previous: ScenarioResult | None = None) -> ScenarioResult:
        """Runs ``scenario``; ``previous`` (the scenario run before it) sets the open loop's rate
        when the scenario has a ``capacity_fraction``.

        Raises:
            ValueError: a capacity_fraction with no previous scenario or one that completed nothing.
        """
        probe = ClusterProbe(self.cluster)
        rss_before = probe.rss_bytes()
        c = self.campaign
        rate = 0.0
        if scenario.capacity_fraction:
            if previous is None or previous.completion_rate_per_s <= 0:
                raise ValueError(f"{scenario.name}: capacity_fraction needs a scenario before it that completed requests")
            rate = scenario.capacity_fraction * previous.completion_rate_per_s
        duration_s = c.duration_s if scenario.duration_s is None else scenario.duration_s
        driver = Driver(self.requests, self.client, c.concurrency, c.deadline_s, seed, duration_s, rate,
                        tuple(r.http_url for r in self.cluster.routers))
        ctx = FaultContext(self.cluster, driver, self.fault_file, links=self.links)
        events: list[str] = []
        supervisor = asyncio.create_task(self._supervise(ctx, events))
        sampler = Sampler(probe, driver, c.sample_every_s)
        sampling = asyncio.create_task(sampler.run()) if c.sample_every_s > 0 else None
        meter = CpuMeter(lambda: [os.getpid(), *(s.process.pid for s in self.cluster.services)], driver.progress.now_s)
        metering = asyncio.create_task(meter.run())
        try:
            logs = [FaultLog(f) for f in scenario.faults]
            fault_tasks = [asyncio.create_task(run_fault(f, ctx, log)) for f, log in zip(scenario.faults, logs)]
            outcomes = await driver.run()
            for task, log in zip(fault_tasks, logs):
                if log.note == "not triggered":  # its time or token count never came
                    task.cancel()
            await asyncio.gather(*fault_tasks, return_exceptions=True)
            resume_stopped(ctx)
            duration_s = driver.progress.now_s()
            metering.cancel()
            if sampling is not None:
                sampling.cancel()
                await asyncio.gather(sampling, return_exceptions=True)
                sampler.samples.append(await asyncio.to_thread(sampler.take))  # the run's end
            await self._wait_whole()
            idle_after_s, _, leaked = await wait_idle(probe, self.campaign.idle_bound_s)
        finally:
            resume_stopped(ctx)
            if sampling is not None:
                sampling.cancel()
            metering.cancel()
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)
        rss_growth = probe.rss_bytes() - rss_before
        probe.close()
        triggered = [f for f in logs if f.note != "not triggered"]
        recovered = recovery_of(driver.progress, triggered, meter.other_cores)
        return ScenarioResult(scenario.name, logs, count(outcomes, self.requests, self.refs), leaked, idle_after_s,
                              rss_growth, recovered, duration_s, _examples(outcomes),
                              events, sampler.samples, rate, self._detected(triggered),
                              tokens_each_s(driver.progress.token_times_s), meter.other_cores)

    def _detected(self, triggered: list[FaultLog]) -> float | None:
        """Seconds from the scenario's first partition until a router showed it noticed (None: no
        partition, or none did; a pool node's has no such sign):

        - a worker's link: a router marked it down (``marked down``, its advertised address);
        - a router's Redis: that router could not read the registry;
        - a worker's Redis: a router saw its heartbeat stop (``heartbeat``, its address: kept as
          it answers SERVING, or lost).
        """
        partitions = [f for f in triggered if f.fault.do == "partition"]
        if not partitions or self.links is None:
            return None
        first, log_dir = partitions[0], self.cluster.config.log_dir
        fault = first.fault
        routers = [log_dir / f"{r.name}.log" for r in self.cluster.routers]
        if fault.client.startswith("router"):
            return detect_s([log_dir / f"{fault.client}.log"], ("cannot read the worker registry",), first.started_at)
        if fault.client.startswith(("prefill", "decode")):
            address = self.cluster.advertised.get(fault.client) or self.cluster.addresses[fault.client]
            return detect_s(routers, ("heartbeat", address), first.started_at)
        if fault.client or fault.service.startswith("kv_pool"):
            return None
        return detect_s(routers, ("marked down", self.links.proxies[fault.link].address), first.started_at)

    async def _supervise(self, ctx: FaultContext, events: list[str]) -> None:
        while True:
            events += supervise(ctx)
            await asyncio.sleep(SUPERVISE_INTERVAL_S)

    async def _wait_whole(self) -> None:
        """Until every service runs and every router sees every worker (or WHOLE_TIMEOUT_S).

        Raises:
            RuntimeError: the cluster is not whole in time.
        """
        deadline = time.monotonic() + WHOLE_TIMEOUT_S
        async with httpx.AsyncClient(timeout=5) as http:
            while True:
                seen = {r.name: await self._router_counts(http, r.http_url) for r in self.cluster.routers}
                running = all(s.exit_code() is None for s in self.cluster.services)
                if running and all(counts.get(role) == n for counts in seen.values()
                                   for role, n in self.expected_workers.items()):
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster is not whole {WHOLE_TIMEOUT_S:g} s after the run: routers "
                                       f"see {seen}, expected {self.expected_workers}")
                await asyncio.sleep(0.5)  # polling the routers, not synchronising

    @staticmethod
    async def _router_counts(http: httpx.AsyncClient, url: str) -> dict:
        """Workers by role as the router at ``url`` sees them ({} when it does not answer)."""
        try:
            return (await http.get(f"{url}/health")).json().get("workers", {})
        except (httpx.HTTPError, ValueError):
            return {}



def result_json(result: ScenarioResult) -> dict:
    data = dataclasses.asdict(result)
    data["completion_rate_per_s"] = round(result.completion_rate_per_s, 4)
    data["recovery"] = {key: None if value is None else round(value, 3) for key, value in data["recovery"].items()}
    data["other_cores"] = [[round(t_s, 1), round(cores, 2)] for t_s, cores in result.other_cores]
    data["recovery"]["measure"] = (f"seconds from the last fault's end until the token rate over {WINDOW_S:g} s is at "
                                   f"least {HALF_FRACTION:g} (to_half_s) and {BASELINE_FRACTION:g} (to_baseline_s) "
                                   "x the rate before the first fault (baseline_tokens_per_s); other_cores_*: the "
                                   "CPU of the machine's other jobs over the baseline and the "
                                   f"{AFTER_HEAL_S:g} s after the heal")
    if result.samples:
        data["sample_summary"] = summary(result.samples)
    data["faults"] = [{"fault": f.fault.label, "start_s": round(f.start_s, 2), "end_s": round(f.end_s, 2),
                       "started_at": round(f.started_at, 3), "note": f.note} for f in result.faults]
    return data
