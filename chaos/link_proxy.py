"""A TCP proxy that plays a faulty network link between two services.

Put it between a client and a server (the client dials the proxy's port, the proxy dials the
server) and set its :class:`LinkFault` while traffic flows:

- ``pass``: bytes flow both ways untouched;
- ``blackhole``: a silent partition, as a dropped NetworkPolicy or a dead switch port: the
  proxy stops forwarding in both directions and keeps every connection open, so neither end sees
  a FIN or a RST (packets dropped, not refused); a new connection is accepted and then hears
  nothing. What was sent meanwhile is delivered when the partition heals, as TCP's
  retransmissions would deliver it, unless an end gave up on the connection first;
- ``delay``: each chunk is held ``delay_s`` seconds before it is forwarded (added latency);
- ``bandwidth``: each direction of each connection carries at most ``bytes_per_s``: a chunk is
  forwarded in slices of at most ``bytes_per_s / SLICES_PER_S`` bytes, each followed by the pause
  that keeps the rate (a congested or capped link: bytes arrive late and in pieces, all of them);
- ``reset``: open connections are closed at once (an RST, as a restarted middlebox or a NAT that
  forgot its entries does), each with ``probability``; so is each new connection on accept
  (connections refused or dropped); the others carry bytes untouched.

``one_way`` (``"to_server"`` or ``"to_client"``) applies ``blackhole`` to one direction only.

Faults of a real network that a proxy cannot play (packet reordering, partial packet loss under
TCP's retransmission) show at the gRPC level as delays and stalls, which ``delay`` and
``blackhole`` cover. The kernel's ``netem`` qdisc would play them, where it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

MODES = ("pass", "blackhole", "delay", "bandwidth", "reset")
DIRECTIONS = ("both", "to_server", "to_client")
CHUNK_BYTES = 64 * 1024
SLICES_PER_S = 10  # a bandwidth cap forwards at most a tenth of a second's bytes at once


@dataclass(frozen=True)
class LinkFault:
    """What the link does now (see the module docstring).

    Raises:
        ValueError: an unknown mode or direction, a delay/bandwidth fault without its amount, or a
            probability outside [0, 1].
    """

    mode: str = "pass"
    delay_s: float = 0.0
    bytes_per_s: int = 0
    direction: str = "both"
    probability: float = 1.0  # reset: share of connections closed (open ones when set, new ones on accept)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"link fault mode must be one of {MODES}, got {self.mode!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"link fault direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.mode == "delay" and self.delay_s <= 0:
            raise ValueError(f"a delay fault needs delay_s > 0, got {self.delay_s}")
        if self.mode == "bandwidth" and self.bytes_per_s <= 0:
            raise ValueError(f"a bandwidth fault needs bytes_per_s > 0, got {self.bytes_per_s}")
        if not 0 <= self.probability <= 1:
            raise ValueError(f"a link fault's probability must be in [0, 1], got {self.probability}")

    def stops(self, direction: str) -> bool:
        """Whether bytes going ``direction`` ("to_server" / "to_client") are dropped."""
        return self.mode == "blackhole" and self.direction in ("both", direction)


def bandwidth_slices(data: bytes, bytes_per_s: int) -> list[bytes]:
    """``data`` cut into the slices a ``bytes_per_s`` cap forwards one at a time: each at most
    ``max(1, bytes_per_s // SLICES_PER_S)`` bytes, in order, together exactly ``data``.

    Raises:
        ValueError: ``bytes_per_s`` < 1.
    """
    if bytes_per_s < 1:
        raise ValueError(f"bytes_per_s must be >= 1, got {bytes_per_s}")
    size = max(1, bytes_per_s // SLICES_PER_S)
    return [data[i:i + size] for i in range(0, len(data), size)]


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes the connection with an RST, not a FIN (SO_LINGER 0): the peer's next read or write
    fails ``ECONNRESET``, as when a middlebox drops its state."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class LinkProxy:
    """Listens on ``listen_host:listen_port`` (0: any free port) and forwards to ``target``
    ("host:port"). Runs in the caller's event loop: ``await start()``, ``set_fault(...)``,
    ``await stop()``; :attr:`address` is what clients dial. ``seed`` drives which connections a
    ``reset`` with probability < 1 closes; ``sleep`` is how the proxy waits out a delay or a
    bandwidth pause (seconds; tests pass one that records them)."""

    def __init__(self, target: str, listen_host: str = "127.0.0.1", listen_port: int = 0, seed: int = 0,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep):
        host, _, port = target.rpartition(":")
        self.target_host, self.target_port = host or "127.0.0.1", int(port)
        self.listen_host, self.listen_port = listen_host, listen_port
        self.fault = LinkFault()
        self.rng = random.Random(seed)
        self.sleep = sleep
        self.num_reset = 0  # connections a reset fault closed (open ones and new ones)
        self._fault_changed = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._links: dict[asyncio.StreamWriter, asyncio.StreamWriter] = {}  # open connections: client -> server side
        self._tasks: set[asyncio.Task] = set()
        self.num_connections = 0

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    async def start(self) -> str:
        """Binds; returns :attr:`address`."""
        self._server = await asyncio.start_server(self._accept, self.listen_host, self.listen_port)
        self.listen_port = self._server.sockets[0].getsockname()[1]
        return self.address

    def set_fault(self, fault: LinkFault) -> None:
        """Applies ``fault`` to open and new connections (``reset`` closes open ones now, each
        with its probability). Mutates: the fault, the open connections, :attr:`num_reset`."""
        self.fault = fault
        self._fault_changed.set()
        self._fault_changed = asyncio.Event()
        if fault.mode == "reset":
            for client_writer, server_writer in list(self._links.items()):
                if self.rng.random() < fault.probability:
                    self.num_reset += 1
                    _reset(client_writer)
                    _reset(server_writer)

    async def stop(self) -> None:
        """Closes the listener and every connection."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        if self.fault.mode == "reset" and self.rng.random() < self.fault.probability:
            self.num_reset += 1
            _reset(client_writer)
            return
        self.num_connections += 1
        self._writers.add(client_writer)
        try:
            server_reader, server_writer = await asyncio.open_connection(self.target_host, self.target_port)
        except OSError:
            client_writer.transport.abort()
            self._writers.discard(client_writer)
            return
        self._writers.add(server_writer)
        self._links[client_writer] = server_writer
        pumps = [asyncio.create_task(self._pump(client_reader, server_writer, "to_server")),
                 asyncio.create_task(self._pump(server_reader, client_writer, "to_client"))]
        self._tasks.update(pumps)
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for writer in (client_writer, server_writer):
                writer.transport.abort()
                self._writers.discard(writer)
            self._links.pop(client_writer, None)
            self._tasks.difference_update(pumps)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, direction: str) -> None:
        """Forwards ``reader`` to ``writer`` under the current fault until either side closes."""
        while True:
            data = await reader.read(CHUNK_BYTES)
            if not data:
                return
            while self.fault.stops(direction):  # held (dropped) until the fault changes
                await self._fault_changed.wait()
            fault = self.fault
            if fault.mode == "delay":
                await self.sleep(fault.delay_s)  # the link's latency, not a wait for an event
            if fault.mode != "bandwidth":
                writer.write(data)
                await writer.drain()
                continue
            for piece in bandwidth_slices(data, fault.bytes_per_s):
                writer.write(piece)
                await writer.drain()
                await self.sleep(len(piece) / fault.bytes_per_s)  # the cap's pace


class LinkProxies:
    """Proxies that outlive any one event loop (a chaos campaign runs each scenario in its own):
    their own loop runs in a daemon thread. Thread-safe; use as a context manager."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxies", daemon=True)
        self._thread.start()
        self.proxies: dict[str, LinkProxy] = {}  # by the name given to add()

    def add(self, name: str, target: str, seed: int = 0) -> str:
        """Starts a proxy named ``name`` in front of ``target``; returns the address to dial.
        ``seed``: its connection choices (LinkProxy)."""
        proxy = LinkProxy(target, seed=seed)
        address = asyncio.run_coroutine_threadsafe(proxy.start(), self._loop).result(timeout=10)
        self.proxies[name] = proxy
        return address

    def set_fault(self, name: str, fault: LinkFault) -> None:
        """Applies ``fault`` to the proxy named ``name`` (KeyError: no such proxy)."""
        proxy = self.proxies[name]
        done = threading.Event()

        def apply() -> None:
            proxy.set_fault(fault)
            done.set()

        self._loop.call_soon_threadsafe(apply)
        done.wait(timeout=10)

    def heal_all(self) -> None:
        """Every link back to ``pass``."""
        for name in self.proxies:
            self.set_fault(name, LinkFault())

    def close(self) -> None:
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(proxy.stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> LinkProxies:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DIRECTIONS", "MODES", "SLICES_PER_S", "LinkFault", "LinkProxies", "LinkProxy", "bandwidth_slices"]
