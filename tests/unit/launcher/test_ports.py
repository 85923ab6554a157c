"""launcher.ports: ports outside the kernel's ephemeral range, never handed out twice."""

from __future__ import annotations

import socket

from launcher import ports


def test_ports_sit_below_the_ephemeral_range_and_are_never_repeated():
    end = ports._ephemeral_range_start()
    chosen = [ports.free_port() for _ in range(300)]
    assert len(set(chosen)) == 300
    assert all(max(1024, end // 2) <= port < end for port in chosen), (end, min(chosen), max(chosen))
    with socket.socket() as s:  # and each is bindable now
        s.bind(("127.0.0.1", chosen[-1]))


def test_a_port_in_use_is_skipped(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]  # free again once probe closes
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        draws = iter([taken, free])
        monkeypatch.setattr(ports, "_ephemeral_range_start", lambda: 65535)
        monkeypatch.setattr(ports.random, "randrange", lambda start, end: next(draws))
        monkeypatch.setattr(ports, "_handed_out", set())
        assert ports.free_port() == free


def test_without_room_below_the_range_the_os_picks(monkeypatch):
    def no_draw(start, end):
        raise AssertionError(f"drew from [{start}, {end})")

    monkeypatch.setattr(ports, "_ephemeral_range_start", lambda: 1500)  # [1024, 1500): under 1,000 ports
    monkeypatch.setattr(ports.random, "randrange", no_draw)
    port = ports.free_port()
    assert port in ports._handed_out
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
