"""Free TCP ports on 127.0.0.1 for the services a launcher starts."""

from __future__ import annotations

import contextlib
import socket


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(num_ports: int, attempts: int = 100) -> int:
    """The first of ``num_ports`` consecutive ports that are free on 127.0.0.1 now (for several
    routers on ``port + i``). Raises RuntimeError when no such run is found in ``attempts`` tries."""
    for _ in range(attempts):
        first = free_port()
        if first + num_ports - 1 > 65535:
            continue
        with contextlib.ExitStack() as held:  # hold each port while checking the next
            try:
                for port in range(first, first + num_ports):
                    sock = held.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return first
    raise RuntimeError(f"no {num_ports} consecutive free ports found in {attempts} tries")
