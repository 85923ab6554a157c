"""Which host a process runs on, precisely enough to know whether a file in /dev/shm is shared."""

from __future__ import annotations

import functools
import socket


@functools.cache
def host_id() -> str:
    """Hostname plus the kernel's boot id: two containers with one hostname but separate kernels
    (or a rebooted host) differ. Reads /proc once."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "unknown-boot"
    return f"{socket.gethostname()}/{boot_id}"
