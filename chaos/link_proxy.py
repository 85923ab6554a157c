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
- ``bandwidth``: each direction of each connection carries at most ``bytes_per_s``;
- ``reset``: every open connection is closed at once and new ones are closed on accept
  (connections refused or dropped);

``one_way`` (``"to_server"`` or ``"to_client"``) applies ``blackhole`` to one direction only.

Faults of a real network that a proxy cannot play (packet reordering, partial packet loss under
TCP's retransmission) show at the gRPC level as delays and stalls, which ``delay`` and
``blackhole`` cover. The kernel's ``netem`` qdisc would play them, where it exists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass

log = logging.getLogger(__name__)

MODES = ("pass", "blackhole", "delay", "bandwidth", "reset")
DIRECTIONS = ("both", "to_server", "to_client")
CHUNK_BYTES = 64 * 1024


@dataclass(frozen=True)
class LinkFault:
    """What the link does now (see the module docstring).

    Raises:
        ValueError: an unknown mode or direction, or a delay/bandwidth fault without its amount.
    """

    mode: str = "pass"
    delay_s: float = 0.0
    bytes_per_s: int = 0
    direction: str = "both"

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"link fault mode must be one of {MODES}, got {self.mode!r}")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"link fault direction must be one of {DIRECTIONS}, got {self.direction!r}")
        if self.mode == "delay" and self.delay_s <= 0:
            raise ValueError(f"a delay fault needs delay_s > 0, got {self.delay_s}")
        if self.mode == "bandwidth" and self.bytes_per_s <= 0:
            raise ValueError(f"a bandwidth fault needs bytes_per_s > 0, got {self.bytes_per_s}")

    def stops(self, direction: str) -> bool:
        """Whether bytes going ``direction`` ("to_server" / "to_client") are dropped."""
        return self.mode == "blackhole" and self.direction in ("both", direction)


class LinkProxy:
    """Listens on ``listen_host:listen_port`` (0: any free port) and forwards to ``target``
    ("host:port"). Runs in the caller's event loop: ``await start()``, ``set_fault(...)``,
    ``await stop()``; :attr:`address` is what clients dial."""

    def __init__(self, target: str, listen_host: str = "127.0.0.1", listen_port: int = 0):
        host, _, port = target.rpartition(":")
        self.target_host, self.target_port = host or "127.0.0.1", int(port)
        self.listen_host, self.listen_port = listen_host, listen_port
        self.fault = LinkFault()
        self._fault_changed = asyncio.Event()
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
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
        """Applies ``fault`` to open and new connections (``reset`` closes the open ones now)."""
        self.fault = fault
        self._fault_changed.set()
        self._fault_changed = asyncio.Event()
        if fault.mode == "reset":
            for writer in list(self._writers):
                writer.transport.abort()

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
        if self.fault.mode == "reset":
            client_writer.transport.abort()
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
                await asyncio.sleep(fault.delay_s)  # the link's latency, not a wait for an event
            elif fault.mode == "bandwidth":
                await asyncio.sleep(len(data) / fault.bytes_per_s)
            elif fault.mode == "reset":
                return
            writer.write(data)
            await writer.drain()


class LinkProxies:
    """Proxies that outlive any one event loop (a chaos campaign runs each scenario in its own):
    their own loop runs in a daemon thread. Thread-safe; use as a context manager."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="link-proxies", daemon=True)
        self._thread.start()
        self.proxies: dict[str, LinkProxy] = {}  # by the name given to add()

    def add(self, name: str, target: str) -> str:
        """Starts a proxy named ``name`` in front of ``target``; returns the address to dial."""
        proxy = LinkProxy(target)
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


__all__ = ["DIRECTIONS", "MODES", "LinkFault", "LinkProxies", "LinkProxy"]
