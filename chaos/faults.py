"""What each fault of a schedule does to a running local cluster (chaos.schedule.FAULT_KINDS).

- ``sigkill``: SIGKILL of ``service``; ``tandem up``'s supervision restarts it (the router is
  never restarted: killing it ends the run).
- ``sigstop``: SIGSTOP of ``service`` (a hung process), SIGCONT after ``duration_s``.
- ``redis_restart``: SIGKILL of the private Redis; supervision starts it again at once, empty.
- ``redis_down``: SIGKILL of Redis, held down ``duration_s`` (connections refused), then started
  again, empty.
- ``redis_pause``: SIGSTOP of Redis for ``duration_s`` (connections hang; clients time out).
- ``pool_dram_full``: fills the pool's free DRAM with request-scoped blocks of a request of its
  own, holds them ``duration_s``, then releases them.
- ``transfer``: for ``duration_s``, the pool's gRPC server applies ``mode`` (delay ``delay_s``,
  error, truncate, corrupt) to ``methods`` with ``probability`` (core.fault_injection; the
  harness starts every service with the fault file).
- ``disconnect``: for ``duration_s`` (0: the rest of the run), each request sent has
  ``fraction`` chance to disconnect at ``stage``.
- ``abort_storm``: ``fraction`` of the requests in flight are cancelled within one second.
- ``burst``: ``multiplier`` x concurrency extra requests sent at once.
- ``partition``: for ``duration_s`` the link to ``service`` drops every packet (``direction``:
  both ways, or only ``to_server`` / ``to_client``) without closing a connection, then heals.
  A worker's link is the routers' calls to it (it keeps heartbeating to Redis: a split view); a
  pool node's is every gRPC call of the workers and routers to it (its Redis index stays).
  Played by a chaos.link_proxy proxy that the campaign puts in front of ``service`` (the address
  it advertises, and for a pool node the workers' ``--pool-address``).
  On ``service: redis`` the link is ``client``'s connection to Redis (a router that cannot read
  the registry, a worker or pool node whose heartbeats do not arrive); the other services keep
  theirs.
- ``slow_link``: for ``duration_s`` that link holds each chunk ``delay_s`` seconds.
- ``throttle_link``: for ``duration_s`` that link carries at most ``bytes_per_s`` each way.
- ``drop_connections``: the link's open connections are reset (each with ``probability``), and
  for ``duration_s`` each new one too.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass, field

from chaos.driver import DisconnectPlan, Driver
from chaos.link_proxy import LinkFault, LinkProxies
from chaos.schedule import Fault
from core.block_key import BlockKey
from core.fault_injection import FaultRule, write_rules
from core.pool_client import PoolClient
from launcher.local_cluster import LocalCluster

FILL_BLOCK_BYTES = 4 * 1024 * 1024
FILL_REQUEST_ID = "chaos-pool-fill"


@dataclass
class FaultLog:
    """When each fault ran (run seconds) and what it did."""

    fault: Fault
    start_s: float = 0.0
    end_s: float = 0.0
    note: str = "not triggered"
    started_at: float = 0.0  # wall clock (time.time()) when it was applied


@dataclass
class FaultContext:
    cluster: LocalCluster
    driver: Driver
    fault_file: str
    held: set[str] = field(default_factory=set)  # services kept out of supervision (redis_down)
    stopped: set[int] = field(default_factory=set)  # pids under SIGSTOP (resumed at the end)
    links: LinkProxies | None = None  # proxies between the routers and the workers named in link faults


async def run_fault(fault: Fault, ctx: FaultContext, log: FaultLog) -> FaultLog:
    """Waits for the fault's trigger, applies it, waits out its duration. Fills and returns
    ``log`` (cancelled before the trigger: ``log.note`` stays "not triggered")."""
    progress = ctx.driver.progress
    if fault.at_s is not None:
        await asyncio.sleep(max(0.0, fault.at_s - progress.now_s()))
    else:
        while progress.num_tokens < fault.at_tokens:
            progress.changed.clear()
            await progress.changed.wait()
    log.start_s, log.note, log.started_at = progress.now_s(), "running", time.time()
    try:
        log.note = await _APPLY[fault.do](fault, ctx) or ""
    except Exception as err:  # reported in the row, the run goes on
        log.note = f"fault failed: {type(err).__name__}: {err}"
    log.end_s = progress.now_s()
    return log


def _pid(ctx: FaultContext, name: str) -> int:
    return ctx.cluster.service(name).process.pid


async def _sigkill(fault: Fault, ctx: FaultContext) -> str:
    pid = _pid(ctx, fault.service)
    os.kill(pid, signal.SIGKILL)
    return f"killed pid {pid}"


async def _sigstop(fault: Fault, ctx: FaultContext) -> str:
    pid = _pid(ctx, fault.service)
    os.kill(pid, signal.SIGSTOP)
    ctx.stopped.add(pid)
    await asyncio.sleep(fault.duration_s)
    os.kill(pid, signal.SIGCONT)
    ctx.stopped.discard(pid)
    return f"stopped pid {pid} for {fault.duration_s:g} s"


async def _redis_restart(fault: Fault, ctx: FaultContext) -> str:
    os.kill(_pid(ctx, "redis"), signal.SIGKILL)
    return "Redis killed; supervision restarts it empty"


async def _redis_down(fault: Fault, ctx: FaultContext) -> str:
    ctx.held.add("redis")
    os.kill(_pid(ctx, "redis"), signal.SIGKILL)
    await asyncio.sleep(fault.duration_s)
    ctx.held.discard("redis")
    return f"Redis down {fault.duration_s:g} s, then restarted empty"


async def _redis_pause(fault: Fault, ctx: FaultContext) -> str:
    return await _sigstop(Fault("sigstop", at_s=0, service="redis", duration_s=fault.duration_s), ctx)


async def _pool_dram_full(fault: Fault, ctx: FaultContext) -> str:
    from chaos.probe import ClusterProbe  # blocking stats call, once

    free_bytes = await asyncio.to_thread(lambda: ClusterProbe(ctx.cluster).pool_capacity_bytes())
    with PoolClient(ctx.cluster.addresses["kv_pool"], timeout_s=30) as pool:  # blocking calls, in a thread
        num_blocks = 0
        for i in range(max(1, free_bytes // FILL_BLOCK_BYTES + 1)):
            key = BlockKey.scoped("chaos-fill", FILL_REQUEST_ID, i)
            try:
                await asyncio.to_thread(pool.put_blocks, [(key, bytes(FILL_BLOCK_BYTES))], FILL_REQUEST_ID,
                                        fault.duration_s + 60)
            except Exception:  # full: RESOURCE_EXHAUSTED
                break
            num_blocks += 1
        await asyncio.sleep(fault.duration_s)
        await asyncio.to_thread(pool.release_request, FILL_REQUEST_ID)
    return f"held {num_blocks} blocks of {FILL_BLOCK_BYTES} bytes for {fault.duration_s:g} s"


async def _transfer(fault: Fault, ctx: FaultContext) -> str:
    rule = FaultRule(fault.mode, fault.methods, fault.probability, fault.delay_s)
    write_rules(ctx.fault_file, [rule])
    await asyncio.sleep(fault.duration_s)
    write_rules(ctx.fault_file, [])
    return f"{fault.mode} on {','.join(fault.methods)} for {fault.duration_s:g} s"


async def _disconnect(fault: Fault, ctx: FaultContext) -> str:
    now_s = ctx.driver.progress.now_s()
    until_s = now_s + fault.duration_s if fault.duration_s else float("inf")
    ctx.driver.disconnect = DisconnectPlan(fault.stage, fault.fraction, until_s)
    return f"{fault.fraction:g} of new requests disconnect {fault.stage}"


async def _abort_storm(fault: Fault, ctx: FaultContext) -> str:
    return f"cancelled {await ctx.driver.abort_storm(fault.fraction)} requests in flight"


async def _burst(fault: Fault, ctx: FaultContext) -> str:
    num = fault.multiplier * ctx.driver.concurrency
    ctx.driver.burst(num)
    return f"sent {num} extra requests at once"


async def _hold_link(fault: Fault, ctx: FaultContext, link_fault: LinkFault) -> None:
    """Applies ``link_fault`` to ``fault.service``'s proxy for ``fault.duration_s``, then heals it.

    Raises:
        ValueError: the service has no link proxy.
    """
    if ctx.links is None or fault.link not in ctx.links.proxies:
        raise ValueError(f"{fault.link} has no link proxy (the campaign puts one on each link a fault names)")
    ctx.links.set_fault(fault.link, link_fault)
    try:
        await asyncio.sleep(fault.duration_s)  # the fault's duration, not a wait for an event
    finally:
        ctx.links.set_fault(fault.link, LinkFault())


async def _partition(fault: Fault, ctx: FaultContext) -> str:
    await _hold_link(fault, ctx, LinkFault("blackhole", direction=fault.direction))
    return f"packets on {fault.link} dropped ({fault.direction}) for {fault.duration_s:g} s, then healed"


async def _slow_link(fault: Fault, ctx: FaultContext) -> str:
    await _hold_link(fault, ctx, LinkFault("delay", delay_s=fault.delay_s))
    return f"{fault.link} +{fault.delay_s:g} s per chunk for {fault.duration_s:g} s"


async def _throttle_link(fault: Fault, ctx: FaultContext) -> str:
    await _hold_link(fault, ctx, LinkFault("bandwidth", bytes_per_s=fault.bytes_per_s))
    return f"{fault.link} capped at {fault.bytes_per_s} B/s each way for {fault.duration_s:g} s"


async def _drop_connections(fault: Fault, ctx: FaultContext) -> str:
    proxy = ctx.links.proxies.get(fault.link) if ctx.links is not None else None
    before = proxy.num_reset if proxy is not None else 0
    await _hold_link(fault, ctx, LinkFault("reset", probability=fault.probability))
    reset = proxy.num_reset - before if proxy is not None else 0
    return f"{reset} connections of {fault.link} reset (p={fault.probability:g}) over {fault.duration_s:g} s"


_APPLY = {
    "sigkill": _sigkill, "sigstop": _sigstop, "redis_restart": _redis_restart, "redis_down": _redis_down,
    "redis_pause": _redis_pause, "pool_dram_full": _pool_dram_full, "transfer": _transfer,
    "disconnect": _disconnect, "abort_storm": _abort_storm, "burst": _burst, "partition": _partition,
    "slow_link": _slow_link, "throttle_link": _throttle_link, "drop_connections": _drop_connections,
}


def resume_stopped(ctx: FaultContext) -> None:
    """SIGCONT to every process a fault left stopped, and every link healed (a scenario that
    ended early)."""
    if ctx.links is not None:
        ctx.links.heal_all()
    for pid in list(ctx.stopped):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        ctx.stopped.discard(pid)


def supervise(ctx: FaultContext) -> list[str]:
    """One supervision pass over the cluster's services but the held ones (launcher.supervisor)."""
    return ctx.cluster.supervise(exclude=frozenset(ctx.held))
