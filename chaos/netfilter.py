"""Silent partitions between two IP addresses as iptables rules: the fault backend for pods.

On a Kubernetes node each pod is a network namespace on the node's bridge, so the packets between
two pods cross the node's netfilter (FORWARD; OUTPUT for the node's own processes). A partition
is a ``DROP`` rule per direction matching the two addresses (``-s A -d B``): the packets vanish,
no RST and no ICMP, as a NetworkPolicy or a firewall change does it, so both ends see a silent
peer and the cluster's keepalives have to find it (docs/failover.md).

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
    """The DROP rules of one partition (each an iptables rule spec without ``-A CHAIN``)."""

    client: str
    server: str
    direction: str
    rules: tuple[tuple[str, ...], ...] = field(default=())


class Netfilter:
    """Adds and removes partition rules in :data:`CHAIN` through ``prefix + [iptables, ...]``.

    Raises (every method that changes rules): RuntimeError quoting iptables' error when a
    command fails (not root, no such binary in the prefix's namespace, ...).
    """

    def __init__(self, prefix: Sequence[str] = (), iptables: str = "iptables", run: Runner = _run):
        self.prefix, self.iptables, self.run = list(prefix), iptables, run

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
        for address in (client, server):
            try:
                ip_address(address)
            except ValueError:
                raise ValueError(f"a partition needs IP addresses, got {address!r}") from None
        if direction not in DIRECTIONS:
            raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
        pairs = {"both": [(client, server), (server, client)], "to_server": [(client, server)],
                 "to_client": [(server, client)]}[direction]
        rules = tuple(("-s", src, "-d", dst, "-m", "comment", "--comment", COMMENT, "-j", "DROP") for src, dst in pairs)
        self.install()
        for rule in rules:
            self._call("-A", CHAIN, *rule)
        return Partition(client, server, direction, rules)

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
                   sleep: Callable[[float], None] | None = None) -> Partition:
    """Partitions ``client`` and ``server`` for ``duration_s``, then heals, and removes the chain:
    also when interrupted (SIGINT, SIGTERM, SIGHUP: the interruption propagates after the
    cleanup). Returns the partition it held.

    Raises:
        ValueError / RuntimeError: as :meth:`Netfilter.partition`.
        KeyboardInterrupt / Interrupted: the run was stopped (rules removed first).
    """
    import time

    wait = sleep or time.sleep
    with signals_raise():
        try:
            partition = netfilter.partition(client, server, direction)
            on_progress(f"partition {client} <-> {server} ({direction}) for {duration_s:g} s")
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
