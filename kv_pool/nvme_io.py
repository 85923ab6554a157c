"""How the NVMe tier moves block bytes to and from its file (``--nvme-io``).

- ``os``: one ``os.pwrite`` / ``os.pread`` per block (the default);
- ``nixl``: NIXL's POSIX backend (the storage plugin NIXL uses for local files; GDS where a GPU
  reads storage directly). The tier's file is registered as FILE memory; the DRAM arena, when
  given, is registered as DRAM, so a demotion writes straight from the block's arena slot; other
  bytes (and reads, which return ``bytes``) go through a registered staging buffer. The plugin's
  default queue completes a transfer inside ``transfer()``; completion is still polled.

Importing ``nixl`` imports torch: ``NixlFileIO`` imports it only when constructed.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np

NVME_IO_MODES = ("os", "nixl")
TRANSFER_TIMEOUT_S = 60.0


class OsFileIO:
    """Block I/O with ``os.pwrite`` / ``os.pread`` on ``fd``."""

    def __init__(self, fd: int, path: str):
        self._fd, self._path = fd, path

    def write(self, offset_bytes: int, data: bytes | memoryview) -> None:
        """Raises OSError on a short write."""
        written = os.pwrite(self._fd, data, offset_bytes)
        if written != len(data):
            raise OSError(f"short write to {self._path}: {written} of {len(data)} bytes")

    def read(self, offset_bytes: int, num_bytes: int) -> bytes:
        """Raises OSError on a short read."""
        data = os.pread(self._fd, num_bytes, offset_bytes)
        if len(data) != num_bytes:
            raise OSError(f"short read from {self._path}: {len(data)} of {num_bytes} bytes")
        return data

    def close(self) -> None:
        pass


class NixlFileIO:
    """Block I/O through a NIXL agent of its own with the POSIX backend.

    ``fd`` / ``path`` / ``capacity_bytes``: the tier's file, registered whole. ``dram``: memory
    (the arena's buffer) registered too, so writes of views into it need no staging copy.

    Raises:
        ImportError: nixl is not installed. RuntimeError / nixl errors: the plugin is missing.
    """

    def __init__(self, fd: int, path: str, capacity_bytes: int, dram=None, staging_bytes: int = 1 << 20):
        from nixl._api import nixl_agent, nixl_agent_config

        self._fd, self._path = fd, path
        self._name = f"tandem-nvme-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._agent = nixl_agent(self._name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self._agent.create_backend("POSIX", {})
        self._regs = [self._agent.register_memory([(0, capacity_bytes, fd, path)], "FILE", backends=["POSIX"])]
        self._dram: tuple[int, int] | None = None  # (address, bytes) of the registered ``dram``
        self._dram_array = None
        if dram is not None:
            self._dram_array = np.frombuffer(dram, dtype=np.uint8)  # pins the mapping while registered
            self._dram = (int(self._dram_array.ctypes.data), len(self._dram_array))
            self._regs.append(self._register_dram(*self._dram))
        self._staging = np.empty(0, dtype=np.uint8)
        self._staging_reg = None
        self._grow_staging(staging_bytes)

    def write(self, offset_bytes: int, data: bytes | memoryview) -> None:
        """Raises OSError when the transfer fails."""
        src = np.frombuffer(data, dtype=np.uint8)
        address = int(src.ctypes.data)
        if self._dram is None or not self._dram[0] <= address <= self._dram[0] + self._dram[1] - len(src):
            self._grow_staging(len(src))
            self._staging[: len(src)] = src
            address = int(self._staging.ctypes.data)
        self._transfer("WRITE", address, offset_bytes, len(src))

    def read(self, offset_bytes: int, num_bytes: int) -> bytes:
        """Raises OSError when the transfer fails."""
        self._grow_staging(num_bytes)
        self._transfer("READ", int(self._staging.ctypes.data), offset_bytes, num_bytes)
        return self._staging[:num_bytes].tobytes()

    def close(self) -> None:
        """Deregisters every region. Idempotent."""
        for reg in [*self._regs, self._staging_reg]:
            if reg is not None:
                self._agent.deregister_memory(reg)
        self._regs, self._staging_reg, self._dram_array = [], None, None

    def _register_dram(self, address: int, num_bytes: int):
        return self._agent.register_memory([(address, num_bytes, 0, "")], "DRAM", backends=["POSIX"])

    def _grow_staging(self, num_bytes: int) -> None:
        if len(self._staging) >= num_bytes:
            return
        if self._staging_reg is not None:
            self._agent.deregister_memory(self._staging_reg)
        self._staging = np.empty(num_bytes, dtype=np.uint8)
        self._staging_reg = self._register_dram(int(self._staging.ctypes.data), num_bytes)

    def _transfer(self, op: str, address: int, offset_bytes: int, num_bytes: int) -> None:
        local = self._agent.get_xfer_descs([(address, num_bytes, 0)], "DRAM")
        remote = self._agent.get_xfer_descs([(offset_bytes, num_bytes, self._fd)], "FILE")
        handle = self._agent.initialize_xfer(op, local, remote, self._name)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise OSError(f"NIXL POSIX {op} of {num_bytes} bytes at {offset_bytes} timed out")
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL POSIX {op} of {num_bytes} bytes at {offset_bytes} failed: {state}")
        finally:
            self._agent.release_xfer_handle(handle)
