"""The pool's NIXL agent: registers the DRAM arena so workers read and write blocks one-sided
over UCX (loopback TCP here, RDMA / NVLink where the hardware has it).

The pool never initiates a transfer: a worker leases (LocateBlocks) or reserves (ReserveBlocks)
slots over gRPC, moves the bytes with NIXL READ / WRITE against ``arena address + offset``, and
commits over gRPC. UCX over TCP needs the target to make progress, so the agent runs NIXL's
progress thread (about a fifth of a core while idle on this machine: off by default, ``--nixl on``).

Importing ``nixl`` imports torch: this module is only imported when NIXL is turned on.
"""

from __future__ import annotations

import logging

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from kv_pool.arena import Arena

log = logging.getLogger(__name__)


class PoolNixlAgent:
    """A NIXL agent named ``name`` with ``arena`` registered as DRAM."""

    def __init__(self, name: str, arena: Arena):
        self.name = name
        self._agent = nixl_agent(name, nixl_agent_config(backends=["UCX"]))
        self._array = np.frombuffer(arena.buffer, dtype=np.uint8)  # pins the mapping while registered
        self.arena_address = int(self._array.ctypes.data)
        self._registered = self._agent.register_memory([(self.arena_address, arena.capacity_bytes, 0, "")], "DRAM")
        self.metadata: bytes = self._agent.get_agent_metadata()
        log.info("NIXL agent %s serves the arena (%d bytes) at 0x%x", name, arena.capacity_bytes, self.arena_address)

    def close(self) -> None:
        """Deregisters the arena and lets go of the mapping."""
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None
            self._array = None
