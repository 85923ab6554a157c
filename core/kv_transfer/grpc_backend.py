"""Bytes streamed through the pool's gRPC service: works from anywhere the pool is reachable."""

from __future__ import annotations

from collections.abc import Sequence

from core.block_key import BlockKey
from core.kv_transfer.backend import ReadBlock, TransferBackend, place
from core.pool_client import BlockBytes


class GrpcBackend(TransferBackend):
    name = "grpc"

    def read(
        self, keys: Sequence[BlockKey], request_id: str, ttl_s: float, out: memoryview | None = None
    ) -> list[ReadBlock]:
        locations = self.client.locate_blocks(keys, request_id, ttl_s)  # leases first
        if not locations:
            return []
        lease_id = locations[0].lease_id
        blocks = self.client.get_blocks_with_checksums(keys[: len(locations)])
        if out is None:
            return [ReadBlock(data, checksum, lease_id) for data, checksum in blocks]
        offsets = [0]
        for data, _ in blocks:
            offsets.append(offsets[-1] + len(data))
        return [ReadBlock(place(out, o, data), checksum, lease_id) for o, (data, checksum) in zip(offsets, blocks)]

    def write(
        self, keys: Sequence[BlockKey], payloads: Sequence[BlockBytes], checksums: Sequence[int],
        request_id: str, ttl_s: float,
    ) -> tuple[int, int]:
        return self.client.put_blocks(zip(keys, payloads), request_id, ttl_s, checksums)
