"""``tandem.v1.KVPool`` over grpc.aio: converts protobuf to domain calls on the block store.

Error codes: malformed input → INVALID_ARGUMENT, pool full → RESOURCE_EXHAUSTED, unknown block
→ NOT_FOUND, a scoped block whose request was released mid-upload → ABORTED.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc

from core.pool_client import MAX_CHUNK_BYTES
from core.proto_convert import block_key_from_proto
from kv_pool.block_store import BlockStore, PoolFullError, StaleReservationError
from kv_pool.metrics import PoolMetrics
from kv_pool.put_session import Chunk, PutSession
from tandem.v1 import kv_pool_pb2, kv_pool_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = "tandem.v1.KVPool"


def _chunk_from_proto(msg: kv_pool_pb2.PutBlocksRequest) -> Chunk:
    """Raises ValueError when the key names neither a hash nor a scoped block."""
    return Chunk(
        key=block_key_from_proto(msg.key) if msg.HasField("key") else None,
        block_bytes=msg.block_bytes,
        offset_bytes=msg.offset_bytes,
        data=msg.data,
        lease_request_id=msg.lease_request_id,
        lease_ttl_s=msg.lease_ttl_ms / 1000,
    )


class KVPoolServicer(kv_pool_pb2_grpc.KVPoolServicer):
    """Serves one block store; ``default_ttl_s`` applies when a request gives ``ttl_ms`` 0."""

    def __init__(self, store: BlockStore, metrics: PoolMetrics, default_ttl_s: float):
        self._store = store
        self._metrics = metrics
        self._default_ttl_s = default_ttl_s

    async def Lookup(self, request, context):
        await _require(context, request.spec_fingerprint, "spec_fingerprint")
        num_hit = self._store.lookup(request.spec_fingerprint, request.block_hashes)
        return kv_pool_pb2.LookupResponse(num_hit_blocks=num_hit)

    async def AcquireLease(self, request, context):
        await _require(context, request.spec_fingerprint, "spec_fingerprint")
        await _require(context, request.request_id, "request_id")
        ttl_s = request.ttl_ms / 1000 or self._default_ttl_s
        num_hit = self._store.acquire_lease(request.spec_fingerprint, request.block_hashes, request.request_id, ttl_s)
        return kv_pool_pb2.AcquireLeaseResponse(num_hit_blocks=num_hit)

    async def PutBlocks(self, request_iterator, context):
        session = PutSession(self._store, self._default_ttl_s)
        try:
            async for msg in request_iterator:
                self._metrics.count_put_bytes(len(msg.data))
                session.feed(_chunk_from_proto(msg))
            session.finish()
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except PoolFullError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except StaleReservationError as e:
            await context.abort(grpc.StatusCode.ABORTED, str(e))
        finally:
            session.abort()  # a stream that ended, failed or was cancelled mid-block leaves nothing
        return kv_pool_pb2.PutBlocksResponse(
            num_committed_blocks=session.num_committed_blocks,
            num_duplicate_blocks=session.num_duplicate_blocks,
        )

    async def GetBlocks(self, request, context) -> AsyncIterator[kv_pool_pb2.GetBlocksResponse]:
        views = []
        for key_msg in request.keys:
            try:
                key = block_key_from_proto(key_msg)
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            try:
                # A view keeps the bytes alive: the stream is consistent even if a block is evicted.
                views.append(self._store.get(key))
            except KeyError:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"block {key} is not stored in this pool")
        for key_index, view in enumerate(views):
            for offset in range(0, len(view), MAX_CHUNK_BYTES):
                data = bytes(view[offset : offset + MAX_CHUNK_BYTES])
                self._metrics.count_get_bytes(len(data))
                yield kv_pool_pb2.GetBlocksResponse(
                    key_index=key_index, block_bytes=len(view), offset_bytes=offset, data=data
                )

    async def ReleaseRequest(self, request, context):
        await _require(context, request.request_id, "request_id")
        num_leases, num_freed = self._store.release_request(request.request_id)
        if num_leases or num_freed:
            log.debug("released %d leases, freed %d blocks", num_leases, num_freed,
                      extra={"request_id": request.request_id})
        return kv_pool_pb2.ReleaseRequestResponse(num_released_leases=num_leases, num_freed_blocks=num_freed)

    async def GetStats(self, request, context):
        stats = self._store.stats()
        return kv_pool_pb2.GetPoolStatsResponse(**dataclasses.asdict(stats))


async def _require(context: grpc.aio.ServicerContext, value: str, name: str) -> None:
    """Aborts with INVALID_ARGUMENT when a required string field is empty."""
    if not value:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must not be empty")
