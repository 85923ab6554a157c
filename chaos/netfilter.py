"""Network faults between two IP addresses as iptables rules: the fault backend for pods.

On a Kubernetes node each pod is a network namespace on the node's bridge, so the packets between
two pods cross the node's netfilter (FORWARD; OUTPUT for the node's own processes). Each fault is
one rule per direction matching the two addresses (``-s A -d B``):

- a **partition** (:meth:`Netfilter.partition`): ``DROP``; the packets vanish, no RST and no ICMP,
  as a NetworkPolicy or a firewall change does it, so both ends see a silent peer and the
  cluster's keepalives have to find it (docs/failover.md);
- **packet loss** (:meth:`Netfilter.lose`): ``-m statistic --mode random --probability P`` then
  ``DROP``; each packet independently, so TCP retransmits and the link is slow and jittery;
- a **bandwidth cap** (:meth:`Netfilter.cap`): ``-m hashlimit --hashlimit-above RATE`` then
  ``DROP``, a policer: packets beyond the byte rate (after a burst) are dropped and TCP backs off
  to about that rate;
- **reset connections** (:meth:`Netfilter.reset`): TCP packets answered ``REJECT --reject-with
  tcp-reset``: an open connection is reset at its next packet and a new one is refused, as a
  middlebox that lost its state does it.

There is no latency fault: the node's kernel may lack the netem qdisc, and a rule cannot hold a
packet; the local campaigns' TCP proxy (chaos/link_proxy.py) delays links.

Every rule lives in a chain of Tandem's own, :data:`CHAIN`, that FORWARD and OUTPUT jump to:
Tandem never edits the node's other chains beyond those two jumps, and :meth:`Netfilter.cleanup`
removes both jumps and the whole chain whatever a run left in it. A run removes each rule when
its fault heals and the chain when it ends, in ``finally`` blocks, with SIGTERM and SIGHUP turned
into an exception (:func:`signals_raise`) so a stopped or interrupted run cleans up too; a
SIGKILLed one cannot, which ``tandem chaos --cleanup`` covers.

Commands run through an argv prefix (``ip netns exec NODE`` for a test's namespaces; empty on a
node). Needs root (CAP_NET_ADMIN) and the ``iptables`` binary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address

CHAIN = "TANDEM-CHAOS"
PARENT_CHAINS = ("FORWARD", "OUTPUT")
COMMENT = "tandem-chaos"
DIRECTIONS = ("both", "to_server", "to_client")

Runner = Callable[[list[str]], subprocess.CompletedProcess]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30)


@dataclass(frozen=True)
class Partition:
    """The rules of one fault between two addresses (each an iptables rule spec without ``-A
    CHAIN``); ``kind``: ``drop`` (a partition), ``loss``, ``cap`` or ``reset``."""

    client: str
    server: str
    direction: str
    rules: tuple[tuple[str, ...], ...] = field(default=())
    kind: str = "drop"


class Netfilter:
    """Adds and removes fault rules in :data:`CHAIN` through ``prefix + [iptables, ...]``.

    Raises (every method that changes rules): RuntimeError quoting iptables' error when a
    command fails (not root, no such binary in the prefix's namespace, ...).
    """

    def __init__(self, prefix: Sequence[str] = (), iptables: str = "iptables", run: Runner = _run):
        self.prefix, self.iptables, self.run = list(prefix), iptables, run
        self._caps = 0  # cap faults added: each names its own hashlimit table

    def _call(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        done = self.run([*self.prefix, self.iptables, "-w", *args])
        if check and done.returncode != 0:
            raise RuntimeError(f"iptables {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def install(self) -> None:
        """Creates :data:`CHAIN` (kept if it exists) and the jump to it at the head of FORWARD
        and OUTPUT (one each, however often called). Mutates the node's netfilter."""
        if self._call("-n", "-L", CHAIN, check=False).returncode != 0:
            self._call("-N", CHAIN)
        for parent in PARENT_CHAINS:
            if self._call("-C", parent, "-j", CHAIN, check=False).returncode != 0:
                self._call("-I", parent, "1", "-j", CHAIN)

    def partition(self, client: str, server: str, direction: str = "both") -> Partition:
        """Drops the packets between the IP addresses ``client`` and ``server``: ``both`` ways,
        ``to_server`` (client → server only) or ``to_client``. Installs the chain first.
        Returns the partition, for :meth:`heal`.

        Raises:
            ValueError: an address that is not an IP address, or an unknown direction.
            RuntimeError: iptables failed (see the class).
        """
        return self._add("drop", client, server, direction, (), ("-j", "DROP"))

    def lose(self, client: str, server: str, probability: float, direction: str = "both") -> Partition:
        """Drops each packet between ``client`` and ``server`` with ``probability`` (0 < p < 1),
        independently; otherwise as :meth:`partition`.

        Raises:
            ValueError: as :meth:`partition`, or a probability outside (0, 1).
        """
        if not 0 < probability < 1:
            raise ValueError(f"probability must be in (0, 1), got {probability!r}")
        match = ("-m", "statistic", "--mode", "random", "--probability", f"{probability:g}")
        return self._add("loss", client, server, direction, match, ("-j", "DROP"))

    def cap(self, client: str, server: str, bytes_per_s: int, direction: str = "both",
            burst_bytes: int | None = None) -> Partition:
        """Drops the packets between ``client`` and ``server`` above ``bytes_per_s`` each way once
        ``burst_bytes`` (default: one second's bytes) are spent: a policer, one token bucket per
        rule (its own hashlimit table, named after the rule); otherwise as :meth:`partition`.

        Raises:
            ValueError: as :meth:`partition`, or a rate or burst under 1 byte.
        """
        burst = bytes_per_s if burst_bytes is None else burst_bytes
        if bytes_per_s < 1 or burst < 1:
            raise ValueError(f"bytes_per_s and burst_bytes must be >= 1, got {bytes_per_s!r}, {burst_bytes!r}")
        self._caps += 1
        # hashlimit names are at most 15 characters and shared by the whole namespace
        name = f"tdm-{os.getpid() % 100000}-{self._caps}"[:15]

        def match(i: int) -> tuple[str, ...]:
            return ("-m", "hashlimit", "--hashlimit-above", f"{bytes_per_s}b/s", "--hashlimit-burst", f"{burst}b",
                    "--hashlimit-name", f"{name}{'ab'[i]}")
        return self._add("cap", client, server, direction, match, ("-j", "DROP"))

    def reset(self, client: str, server: str, direction: str = "both") -> Partition:
        """Answers each TCP packet between ``client`` and ``server`` with a reset: open
        connections break at their next packet and new ones are refused (the other protocols
        pass); otherwise as :meth:`partition`."""
        target = ("-j", "REJECT", "--reject-with", "tcp-reset")
        return self._add("reset", client, server, direction, ("-p", "tcp"), target)

    def _add(self, kind: str, client: str, server: str, direction: str,
             match: tuple[str, ...] | Callable[[int], tuple[str, ...]], target: tuple[str, ...]) -> Partition:
        """Appends one rule per direction, ``-s SRC -d DST MATCH -m comment ... TARGET``; ``match``
        is the same for each or, a callable, made from the direction's index."""
        for address in (client, server):
            try:
                ip_address(address)
            except ValueError:
                raise ValueError(f"a partition needs IP addresses, got {address!r}") from None
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        pairs = {"both": [(client, server), (server, client)], "to_server": [(client, server)],
                 "to_client": [(server, client)]}[direction]
        rules = tuple(("-s", src, "-d", dst, *(match(i) if callable(match) else match),
                       "-m", "comment", "--comment", COMMENT, *target) for i, (src, dst) in enumerate(pairs))
        self.install()
        for rule in rules:
            self._call("-A", CHAIN, *rule)
        return Partition(client, server, direction, rules, kind)

    def heal(self, partition: Partition) -> None:
        """Removes ``partition``'s rules (those already gone are skipped)."""
        for rule in partition.rules:
            self._call("-D", CHAIN, *rule, check=False)

    def rules(self) -> list[str]:
        """The rules in :data:`CHAIN` as ``iptables -S`` prints them (empty: no chain, or none)."""
        done = self._call("-S", CHAIN, check=False)
        return [line for line in done.stdout.splitlines() if line.startswith("-A ")] if done.returncode == 0 else []

    def jumps(self) -> list[str]:
        """The parent chains that still jump to :data:`CHAIN`."""
        return [p for p in PARENT_CHAINS if self._call("-C", p, "-j", CHAIN, check=False).returncode == 0]

    def cleanup(self) -> int:
        """Removes every jump to :data:`CHAIN`, its rules and the chain itself: what any run left.
        Returns how many rules the chain held. Safe to call when nothing is there.

        Raises:
            RuntimeError: the chain could not be removed (iptables' error quoted).
        """
        held = len(self.rules())
        for parent in PARENT_CHAINS:
            while self._call("-C", parent, "-j", CHAIN, check=False).returncode == 0:
                self._call("-D", parent, "-j", CHAIN)
        if self._call("-n", "-L", CHAIN, check=False).returncode == 0:
            self._call("-F", CHAIN)
            self._call("-X", CHAIN)
        return held


class Interrupted(BaseException):
    """A signal (SIGTERM, SIGHUP) asked the run to stop: ``finally`` blocks clean up."""


@contextlib.contextmanager
def signals_raise(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside, each of ``signals`` raises :class:`Interrupted` in the main thread (SIGINT
    already raises KeyboardInterrupt), so the ``finally`` blocks that remove rules run; the
    previous handlers come back on exit. Main thread only (Python's signal rule)."""
    def interrupt(signum: int, _frame: object) -> None:
        raise Interrupted(f"signal {signal.Signals(signum).name}")

    previous = {s: signal.signal(s, interrupt) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def signals_ignored(signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """While inside, ``signals`` are ignored (a second Ctrl-C cannot cut a cleanup short); the
    previous handlers come back on exit. Main thread only."""
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def hold_partition(netfilter: Netfilter, client: str, server: str, duration_s: float, direction: str = "both",
                   on_progress: Callable[[str], None] = lambda _: None,
                   sleep: Callable[[float], None] | None = None,
                   add: Callable[..., Partition] = Netfilter.partition, *args: object) -> Partition:
    """Adds ``add(netfilter, client, server, *args, direction)`` (default: a partition; or
    :meth:`Netfilter.lose`, ``cap`` or ``reset`` with their arguments) for ``duration_s``, then
    heals, and removes the chain: also when interrupted (SIGINT, SIGTERM, SIGHUP: the
    interruption propagates after the cleanup). Returns the fault it held.

    Raises:
        ValueError / RuntimeError: as :meth:`Netfilter.partition`.
        KeyboardInterrupt / Interrupted: the run was stopped (rules removed first).
    """
    import time

    wait = sleep or time.sleep
    with signals_raise():
        try:
            partition = add(netfilter, client, server, *args, direction=direction)
            on_progress(f"{partition.kind} {client} <-> {server} ({direction}) for {duration_s:g} s")
            wait(duration_s)  # the fault's duration, not a wait for an event
            netfilter.heal(partition)
            on_progress("healed")
            return partition
        finally:
            with signals_ignored():
                removed = netfilter.cleanup()
            if removed:
                on_progress(f"removed {removed} rule(s) left in {CHAIN}")


__all__ = ["CHAIN", "COMMENT", "DIRECTIONS", "PARENT_CHAINS", "Interrupted", "Netfilter", "Partition",
           "hold_partition", "signals_ignored", "signals_raise"]
