"""One-sided transfer with NIXL (UCX): the worker's agent READs leased blocks out of the pool's
registered arena and WRITEs reserved slots, then commits over gRPC.

Bytes go through a registered staging buffer of this process (``staging_bytes``, grown on
demand), one NIXL request per batch of blocks; a request is complete when ``check_xfer_state``
says DONE, which for a WRITE means the bytes are in the pool's memory, so the commit that
follows never exposes a partial block. Imported only when NIXL is chosen (``nixl`` imports torch).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config

from core.block_key import BlockKey
from core.kv_transfer.backend import ReadBlock, TransferBackend, place
from core.pool_client import BlockBytes, DataPlane, PoolClient

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 60.0


class NixlBackend(TransferBackend):
    name = "nixl"

    def __init__(self, client: PoolClient, plane: DataPlane, staging_bytes: int = 64 * 1024 * 1024):
        super().__init__(client)
        self._agent = nixl_agent(
            f"tandem-worker-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            nixl_agent_config(enable_prog_thread=False, backends=["UCX"]),  # we poll: no busy thread
        )
        self._remote = self._agent.add_remote_agent(plane.nixl_agent_metadata)
        self._remote_base = plane.nixl_arena_address
        self._lock = threading.Lock()  # one staging buffer: one transfer at a time
        self._staging: np.ndarray | None = None
        self._registered = None
        self._ensure_staging(staging_bytes)

    def read(
        self, keys: Sequence[BlockKey], request_id: str, ttl_s: float, out: memoryview | None = None
    ) -> list[ReadBlock]:
        locations = self.client.locate_blocks(keys, request_id, ttl_s)  # leased: slots stay put
        if not locations:
            return []
        blocks: list[ReadBlock] = []
        offset = 0
        with self._lock:
            for batch in self._batches([loc.block_bytes for loc in locations]):
                spans = self._transfer("READ", [(locations[i].offset_bytes, n) for i, n in batch])
                staging = memoryview(self._staging)
                for (i, n), s in zip(batch, spans):
                    blocks.append(ReadBlock(place(out, offset, staging[s : s + n]), locations[i].checksum,
                                             locations[i].lease_id))
                    offset += n
        return blocks

    def write(
        self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
        request_id: str, ttl_s: float,
    ) -> tuple[int, int]:
        if not keys:
            return 0, 0
        views = [memoryview(p).cast("B") for p in payloads]
        sizes = {len(v) for v in views}
        if len(sizes) != 1:
            raise ValueError(f"nixl writes blocks of one size, got sizes {sorted(sizes)}")
        block_bytes = sizes.pop()
        reserved = self.client.reserve_blocks(keys, block_bytes, checksums, request_id, ttl_s)
        todo = [i for i, r in enumerate(reserved) if not r.duplicate]
        ids = [reserved[i].reservation_id for i in todo]
        try:
            with self._lock:
                for batch in self._batches([block_bytes] * len(todo)):
                    offset = 0
                    for j, n in batch:
                        self._staging[offset : offset + n] = np.frombuffer(views[todo[j]], dtype=np.uint8)
                        offset += n
                    self._transfer("WRITE", [(reserved[todo[j]].offset_bytes, n) for j, n in batch])
            num_committed = self.client.commit_blocks(ids)
        except BaseException:
            try:
                self.client.commit_blocks(ids, abort=True)
            except Exception:  # the pool's reservation expiry rolls back
                log.warning("could not roll back %d reserved blocks", len(ids), exc_info=True)
            raise
        return num_committed, len(reserved) - len(ids)

    def close(self) -> None:
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
            self._registered = None
        self._agent.remove_remote_agent(self._remote)

    def _ensure_staging(self, num_bytes: int) -> None:
        if self._staging is not None and len(self._staging) >= num_bytes:
            return
        if self._registered is not None:
            self._agent.deregister_memory(self._registered)
        self._staging = np.empty(num_bytes, dtype=np.uint8)
        address = int(self._staging.ctypes.data)
        self._registered = self._agent.register_memory([(address, num_bytes, 0, "")], "DRAM")

    def _batches(self, sizes: list[int]) -> list[list[tuple[int, int]]]:
        """(index, size) groups that fit the staging buffer (grown to hold the largest block)."""
        if not sizes:
            return []
        self._ensure_staging(max(sizes))
        batches: list[list[tuple[int, int]]] = [[]]
        used = 0
        for i, n in enumerate(sizes):
            if used + n > len(self._staging):
                batches.append([])
                used = 0
            batches[-1].append((i, n))
            used += n
        return batches

    def _transfer(self, op: str, remote: list[tuple[int, int]]) -> list[int]:
        """One NIXL request moving ``remote`` (arena offset, size) spans to/from consecutive
        staging spans; returns the staging offsets. Raises OSError on failure or timeout."""
        base = int(self._staging.ctypes.data)
        local, spans, offset = [], [], 0
        for _, n in remote:
            local.append((base + offset, n, 0))
            spans.append(offset)
            offset += n
        local_descs = self._agent.get_xfer_descs(local, "DRAM")
        remote_descs = self._agent.get_xfer_descs([(self._remote_base + o, n, 0) for o, n in remote], "DRAM")
        handle = self._agent.initialize_xfer(op, local_descs, remote_descs, self._remote)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + TRANSFER_TIMEOUT_S
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise OSError(f"NIXL {op} of {len(remote)} blocks timed out")
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL {op} of {len(remote)} blocks failed: {state}")
        finally:
            self._agent.release_xfer_handle(handle)
        return spans
