"""Free TCP ports on 127.0.0.1 for the services a launcher starts."""

from __future__ import annotations

import contextlib
import random
import socket
import threading

_handed_out: set[int] = set()  # ports free_port returned in this process: never twice
_lock = threading.Lock()


def _ephemeral_range_start() -> int:
    """The first port of the kernel's ephemeral range (Linux: ip_local_port_range; 32768 unset)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free on 127.0.0.1 now, below the kernel's ephemeral range and never returned before
    by this process.

    Below the ephemeral range because outgoing connections take their local ports from it: a port
    the OS picks (bind to 0) could be taken by any connection between this call and the service's
    own bind (a worker's metrics server failed to start with ``Address already in use`` that way).
    Falls back to a port the OS picks when the range below holds fewer than 1,000 ports or 200
    random tries find none free."""
    end = _ephemeral_range_start()
    start = max(1024, end // 2)
    with _lock:
        for _ in range(200 if end - start >= 1000 else 0):
            port = random.randrange(start, end)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port


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
