"""chaos.link_proxy on plain TCP ends, no gRPC: the bandwidth cap forwards every byte in slices
paced by the cap (the pauses are recorded, not timed), a reset fault closes connections with an
RST (the client's read raises), each with its probability from the proxy's seed."""

from __future__ import annotations

import asyncio
import random

import pytest

from chaos.link_proxy import SLICES_PER_S, LinkFault, LinkProxy, bandwidth_slices

WAIT_S = 20.0  # a deadline for a read that must end; never reached when the proxy works


class _Sink:
    """A TCP server that echoes what it reads and keeps a copy."""

    def __init__(self) -> None:
        self.received = bytearray()
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                self.received += data
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        self.server.close()


async def _proxy(sleep=asyncio.sleep, seed: int = 0) -> tuple[_Sink, LinkProxy]:
    sink = _Sink()
    proxy = LinkProxy(await sink.start(), seed=seed, sleep=sleep)
    await proxy.start()
    return sink, proxy


async def _dial(proxy: LinkProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = proxy.address.rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


async def _echoed(proxy: LinkProxy, payload: bytes = b"ping") -> bool:
    """One new connection through ``proxy``: True when ``payload`` came back, False when the
    connection was reset (the read raised or met the end)."""
    reader, writer = await _dial(proxy)
    try:
        writer.write(payload)
        await writer.drain()
        return await asyncio.wait_for(reader.readexactly(len(payload)), WAIT_S) == payload
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    finally:
        writer.close()


def test_bandwidth_slices_cut_data_into_a_tenth_of_a_seconds_bytes():
    data = bytes(range(256)) * 10  # 2560 bytes
    slices = bandwidth_slices(data, 10_000)
    assert [len(s) for s in slices] == [1000, 1000, 560]
    assert b"".join(slices) == data
    assert [len(s) for s in bandwidth_slices(b"abc", 5)] == [1, 1, 1]  # under SLICES_PER_S bytes/s: one byte at a time
    assert bandwidth_slices(b"", 100) == []
    with pytest.raises(ValueError, match="bytes_per_s must be >= 1, got 0"):
        bandwidth_slices(b"x", 0)


async def test_a_throttled_link_delivers_every_byte_in_paced_slices():
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    sink, proxy = await _proxy(sleep=record)
    try:
        rate = 10_000
        proxy.set_fault(LinkFault("bandwidth", bytes_per_s=rate))
        payload = random.Random(1).randbytes(25_000)
        reader, writer = await _dial(proxy)
        writer.write(payload)
        await writer.drain()
        echoed = await asyncio.wait_for(reader.readexactly(len(payload)), WAIT_S)
        writer.close()
        assert echoed == payload and bytes(sink.received) == payload  # both ways, intact, in order
        # One pause per slice, each at most a tenth of a second's bytes, the sum the cap's time for
        # every byte that crossed (to the server and back).
        assert max(slept) <= 1 / SLICES_PER_S
        assert len(slept) >= 2 * len(payload) // (rate // SLICES_PER_S)
        assert sum(slept) == pytest.approx(2 * len(payload) / rate)
    finally:
        await proxy.stop()
        await sink.stop()


async def test_a_reset_closes_open_connections_with_an_rst_and_refuses_new_ones():
    sink, proxy = await _proxy()
    try:
        reader, writer = await _dial(proxy)
        writer.write(b"hello")
        await writer.drain()
        assert await asyncio.wait_for(reader.readexactly(5), WAIT_S) == b"hello"
        proxy.set_fault(LinkFault("reset"))
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(1), WAIT_S)
        writer.close()
        assert await _echoed(proxy) is False  # a new connection is reset on accept
        assert proxy.num_reset == 2
        proxy.set_fault(LinkFault())
        assert await _echoed(proxy) is True  # healed: connections carry bytes again
        assert proxy.num_reset == 2
    finally:
        await proxy.stop()
        await sink.stop()


async def test_a_reset_with_a_probability_drops_the_connections_its_seed_picks():
    sink, proxy = await _proxy(seed=7)
    try:
        proxy.set_fault(LinkFault("reset", probability=0.5))
        seen = [await _echoed(proxy) for _ in range(12)]
        draws = random.Random(7)
        expected = [not draws.random() < 0.5 for _ in range(12)]
        assert seen == expected
        assert proxy.num_reset == expected.count(False) and 0 < proxy.num_reset < 12
    finally:
        await proxy.stop()
        await sink.stop()


def test_a_bad_probability_is_refused():
    with pytest.raises(ValueError, match="probability must be in \\[0, 1\\], got 1.5"):
        LinkFault("reset", probability=1.5)
