"""Network faults between pods in the middle of a load (chaos.netfilter: iptables rules between
pod addresses in the TANDEM-CHAOS chain of the node's netfilter), each held for ``FAULT_S`` and
then healed while streams are in flight:

- silent partitions (DROP): the routers ↔ one of two decode pods (a split view: it still
  heartbeats to Redis), the routers → that pod only (its answers still flow), a decode pod ↔ the
  Redis pod (its heartbeats lost while the routers still reach it), the routers ↔ the prefill pod,
  the prefill pod ↔ the pool pod, the decode pod ↔ the pool pod, the routers ↔ the Redis pod;
- lossy, capped and reset links: 20 % of the packets between the routers and the decode pod
  dropped, the decode pod ↔ pool link policed to ``CAP_BYTES_PER_S``, and the routers' TCP to one
  of two decode pods answered with resets (open streams broken, new connections refused).

Latency is not here: the node's kernel has no netem qdisc and a rule cannot hold a packet (the
local campaign's proxy, chaos/link_proxy.py, delays links).

Each scenario: the load runs ``BASELINE_S`` (the token rate before the fault), the fault is held,
healed, and the load runs ``AFTER_S`` more (the rate after it, chaos.recovery) before it stops.
Every request completes with the Hugging Face answer (explicit errors 0, lost 0, wrong 0); the
workers and the pool, read by their GetStats at their pod IPs (chaos.probe, what the local
campaign counts), are idle within ``IDLE_BOUND_S`` (leaked 0); a fault the routers can see is
detected from their logs within 10 s; the rate is back to 90 % of the baseline within 10 s of the
heal. The numbers go to the report. The chain is removed after each scenario and before the first
(what a killed run left).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from chaos.campaign import detect_s
from chaos.netfilter import Netfilter, Partition, signals_raise
from chaos.probe import ClusterProbe, wait_idle
from chaos.recovery import AFTER_HEAL_S, WINDOW_S, recovery
from tests.k8s.load import Load
from tests.k8s.node import WORKER_PORTS, Node, Pod

pytestmark = pytest.mark.k8s
CONCURRENCY = 6
BASELINE_S = 8.0  # load before the fault: chaos.recovery's ramp and a few windows of baseline
FAULT_S = 12.0
AFTER_S = AFTER_HEAL_S + 2 * WINDOW_S  # load after the heal: room for the 10 s recovery target
DETECT_TARGET_S = 10.0
RECOVERY_TARGET_S = 10.0
IDLE_BOUND_S = 75.0  # the local campaign's idle bound (chaos.schedule): covers the 60 s lease deadline
LOSS_PROBABILITY = 0.2
CAP_BYTES_PER_S = 256 * 1024
POOL_PORT = 50051


@dataclass
class Pods:
    """The release's pods when a scenario starts; ``decode[0]`` is the one a fault names."""

    routers: list[Pod]
    prefill: list[Pod]
    decode: list[Pod]
    pool: list[Pod]
    redis: list[Pod]

    @classmethod
    def of(cls, node: Node) -> Pods:
        return cls(*(node.pods(c) for c in ("router", "prefill", "decode", "kv-pool", "redis")))

    def stats_addresses(self) -> dict[str, str]:
        """GetStats addresses for chaos.probe.ClusterProbe (its names: kv_pool, prefill-i, decode-i)."""
        found = {f"kv_pool-{i}" if i else "kv_pool": f"{p.ip}:{POOL_PORT}" for i, p in enumerate(self.pool)}
        for role in ("prefill", "decode"):
            found |= {f"{role}-{i}": f"{p.ip}:{WORKER_PORTS[role]}" for i, p in enumerate(getattr(self, role))}
        return found


Faults = Callable[[Netfilter, Pods], list[Partition]]


@dataclass(frozen=True)
class Scenario:
    name: str
    faults: Faults  # adds the rules; each returned Partition is healed after FAULT_S
    decode_pods: int = 1
    detect: Callable[[Pods], tuple[str, ...]] | None = None  # router log words that show it noticed


def between(a: str, b: str, add: Callable[..., Partition], *args) -> Faults:
    """``add(netfilter, client_ip, server_ip, *args)`` for every pod of role ``a`` and of ``b``
    (``decode`` is decode[0] alone)."""
    def pods_of(pods: Pods, role: str) -> list[Pod]:
        return pods.decode[:1] if role == "decode" else getattr(pods, role)

    return lambda nf, pods: [add(nf, x.ip, y.ip, *args) for x in pods_of(pods, a) for y in pods_of(pods, b)]


def marked_down(role: str) -> Callable[[Pods], tuple[str, ...]]:
    return lambda pods: ("marked down", getattr(pods, role)[0].ip)


SCENARIOS = [
    Scenario("partition: routers <-> decode pod (1 of 2), a split view",
             between("routers", "decode", Netfilter.partition), 2, marked_down("decode")),
    Scenario("partition one way: routers -> decode pod (1 of 2) dropped, its answers flow",
             between("routers", "decode", Netfilter.partition, "to_server"), 2, marked_down("decode")),
    Scenario("reset: routers <-> decode pod (1 of 2), TCP answered with RST",
             between("routers", "decode", Netfilter.reset), 2, marked_down("decode")),
    Scenario("partition: decode pod <-> Redis pod, the routers still reach it",
             between("decode", "redis", Netfilter.partition), 1, lambda pods: ("heartbeat", pods.decode[0].ip)),
    Scenario("partition: routers <-> prefill pod (the only one)",
             between("routers", "prefill", Netfilter.partition), 1, marked_down("prefill")),
    Scenario("partition: prefill pod <-> pool pod", between("prefill", "pool", Netfilter.partition)),
    Scenario("partition: decode pod <-> pool pod", between("decode", "pool", Netfilter.partition)),
    Scenario("partition: routers <-> Redis pod", between("routers", "redis", Netfilter.partition), 1,
             lambda pods: ("cannot read the worker registry",)),
    Scenario(f"loss: routers <-> decode pod, {LOSS_PROBABILITY:.0%} of packets dropped",
             between("routers", "decode", Netfilter.lose, LOSS_PROBABILITY)),
    Scenario(f"cap: decode pod <-> pool pod policed to {CAP_BYTES_PER_S // 1024} KiB/s each way",
             between("decode", "pool", Netfilter.cap, CAP_BYTES_PER_S)),
]


@pytest.fixture
def netfilter():
    rules = Netfilter()
    rules.cleanup()
    with signals_raise():  # SIGTERM too runs the finally below
        try:
            yield rules
        finally:
            rules.cleanup()
    assert rules.rules() == [] and rules.jumps() == []


@pytest.fixture(scope="module")
def release(node):
    """The node with a number of decode pods each scenario sets (``scaled(n)``); one decode pod
    again after the module (the release as every proof leaves it)."""
    def scaled(decode_pods: int) -> Node:
        if node.replicas("decode") != decode_pods:
            node.scale("decode", decode_pods)
        node.wait_serving(prefill=1, decode=decode_pods)
        return node

    yield scaled
    scaled(1)


async def faulted_run(load: Load, netfilter: Netfilter, pods: Pods, faults: Faults) -> tuple[float, float, float]:
    """BASELINE_S of steady load, the faults for FAULT_S, the heal, AFTER_S more; returns the
    fault's start and end on the load's clock and its start on the wall clock."""
    await load.wait_for(lambda: load.first_tokens >= 2 * CONCURRENCY, "a steady load")
    await asyncio.sleep(BASELINE_S)  # the baseline's duration, not a wait for an event
    started_at, fault_s = time.time(), load.now_s()
    partitions: list[Partition] = []
    try:
        partitions = await asyncio.to_thread(faults, netfilter, pods)
        await asyncio.sleep(FAULT_S)  # the fault's duration, not a wait for an event
    finally:
        for partition in partitions:
            await asyncio.to_thread(netfilter.heal, partition)
    heal_s = load.now_s()
    await asyncio.sleep(AFTER_S)  # the load after the heal, measured by chaos.recovery
    return fault_s, heal_s, started_at


async def run_scenario(node: Node, netfilter: Netfilter, scenario: Scenario) -> tuple[dict, Pods]:
    pods = Pods.of(node)
    async with Load(node.url, concurrency=CONCURRENCY, continuous=True) as load:
        fault_s, heal_s, started_at = await faulted_run(load, netfilter, pods, scenario.faults)
        load.stop()
        tally = await load.finish()
    probe = ClusterProbe(None, pods.stats_addresses())
    try:
        idle_after_s, held_at_end, leaked = await wait_idle(probe, IDLE_BOUND_S)
    finally:
        probe.close()
    back = recovery(sorted(load.token_times_s), fault_s, heal_s)
    numbers = {"sent": tally.sent, "completed": tally.completed, "explicit_errors": tally.explicit_errors,
               "lost": tally.lost - tally.explicit_errors, "wrong": tally.wrong,
               "leaked": sum(leaked.values()), "leaked_by": leaked, "idle_after_s": None if idle_after_s is None else round(idle_after_s, 2),
               "held_at_end": held_at_end,
               "baseline_tokens_per_s": _round(back.baseline_tokens_per_s),
               "recovery_to_90_s": _round(back.to_baseline_s), "recovery_to_50_s": _round(back.to_half_s),
               "errors": tally.errors, "started_at": started_at}
    return numbers, pods


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def router_logs(node: Node, pods: Pods, tmp_path: Path) -> list[Path]:
    paths = []
    for pod in pods.routers:
        path = tmp_path / f"{pod.name}.log"
        path.write_text(node.kubectl("logs", pod.name))
        paths.append(path)
    return paths


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name.split(":")[0] + "-" + str(SCENARIOS.index(s)))
def test_a_network_fault_between_pods(release, references, record, netfilter, tmp_path, scenario):
    node = release(scenario.decode_pods)
    numbers, pods = asyncio.run(run_scenario(node, netfilter, scenario))
    started_at = numbers.pop("started_at")
    numbers["detected_s"] = None
    if scenario.detect is not None:
        detected = detect_s(router_logs(node, pods, tmp_path), scenario.detect(pods), started_at)
        numbers["detected_s"] = _round(detected)
    assert netfilter.rules() == []  # every rule healed
    record(scenario.name, **numbers)
    assert (numbers["explicit_errors"], numbers["lost"], numbers["wrong"]) == (0, 0, 0), numbers["errors"]
    assert numbers["leaked"] == 0, numbers["leaked_by"]
    if scenario.detect is not None:
        assert numbers["detected_s"] is not None and numbers["detected_s"] <= DETECT_TARGET_S
    assert numbers["recovery_to_90_s"] is not None and numbers["recovery_to_90_s"] <= RECOVERY_TARGET_S, numbers
