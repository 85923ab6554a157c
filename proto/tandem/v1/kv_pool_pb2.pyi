from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutBlocksRequest(_message.Message):
    __slots__ = ("key", "block_bytes", "offset_bytes", "data", "lease_request_id", "lease_ttl_ms", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    block_bytes: int
    offset_bytes: int
    data: bytes
    lease_request_id: str
    lease_ttl_ms: int
    checksum: int
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., block_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., lease_request_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class PutBlocksResponse(_message.Message):
    __slots__ = ("num_committed_blocks", "num_duplicate_blocks")
    NUM_COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DUPLICATE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_committed_blocks: int
    num_duplicate_blocks: int
    def __init__(self, num_committed_blocks: _Optional[int] = ..., num_duplicate_blocks: _Optional[int] = ...) -> None: ...

class GetBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("key_index", "block_bytes", "offset_bytes", "data", "checksum")
    KEY_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key_index: int
    block_bytes: int
    offset_bytes: int
    data: bytes
    checksum: int
    def __init__(self, key_index: _Optional[int] = ..., block_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class ReleaseRequestRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseRequestResponse(_message.Message):
    __slots__ = ("num_released_leases", "num_freed_blocks")
    NUM_RELEASED_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_released_leases: int
    num_freed_blocks: int
    def __init__(self, num_released_leases: _Optional[int] = ..., num_freed_blocks: _Optional[int] = ...) -> None: ...

class GetPoolStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetPoolStatsResponse(_message.Message):
    __slots__ = ("capacity_bytes", "used_bytes", "num_writing_blocks", "num_stored_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases", "num_evicted_blocks", "num_dram_blocks", "num_dram_hits", "num_dram_misses", "nvme_capacity_bytes", "nvme_used_bytes", "num_nvme_blocks", "num_nvme_hits", "num_nvme_misses", "num_nvme_evictions", "num_nvme_promotions", "num_nvme_demotions", "num_corrupt_blocks")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCOPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NVME_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NVME_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_NVME_DEMOTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_writing_blocks: int
    num_stored_blocks: int
    num_leased_blocks: int
    num_scoped_blocks: int
    num_leases: int
    num_evicted_blocks: int
    num_dram_blocks: int
    num_dram_hits: int
    num_dram_misses: int
    nvme_capacity_bytes: int
    nvme_used_bytes: int
    num_nvme_blocks: int
    num_nvme_hits: int
    num_nvme_misses: int
    num_nvme_evictions: int
    num_nvme_promotions: int
    num_nvme_demotions: int
    num_corrupt_blocks: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_writing_blocks: _Optional[int] = ..., num_stored_blocks: _Optional[int] = ..., num_leased_blocks: _Optional[int] = ..., num_scoped_blocks: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., num_dram_blocks: _Optional[int] = ..., num_dram_hits: _Optional[int] = ..., num_dram_misses: _Optional[int] = ..., nvme_capacity_bytes: _Optional[int] = ..., nvme_used_bytes: _Optional[int] = ..., num_nvme_blocks: _Optional[int] = ..., num_nvme_hits: _Optional[int] = ..., num_nvme_misses: _Optional[int] = ..., num_nvme_evictions: _Optional[int] = ..., num_nvme_promotions: _Optional[int] = ..., num_nvme_demotions: _Optional[int] = ..., num_corrupt_blocks: _Optional[int] = ...) -> None: ...

class GetDataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDataPlaneResponse(_message.Message):
    __slots__ = ("host_id", "arena_path", "arena_bytes", "nixl_agent_name", "nixl_agent_metadata", "nixl_arena_address")
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_PATH_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    NIXL_AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    NIXL_ARENA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    host_id: str
    arena_path: str
    arena_bytes: int
    nixl_agent_name: str
    nixl_agent_metadata: bytes
    nixl_arena_address: int
    def __init__(self, host_id: _Optional[str] = ..., arena_path: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., nixl_agent_name: _Optional[str] = ..., nixl_agent_metadata: _Optional[bytes] = ..., nixl_arena_address: _Optional[int] = ...) -> None: ...

class LocateBlocksRequest(_message.Message):
    __slots__ = ("keys", "request_id", "ttl_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    request_id: str
    ttl_ms: int
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ..., request_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class BlockLocation(_message.Message):
    __slots__ = ("offset_bytes", "block_bytes", "checksum")
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    offset_bytes: int
    block_bytes: int
    checksum: int
    def __init__(self, offset_bytes: _Optional[int] = ..., block_bytes: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class LocateBlocksResponse(_message.Message):
    __slots__ = ("locations", "lease_id")
    LOCATIONS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    locations: _containers.RepeatedCompositeFieldContainer[BlockLocation]
    lease_id: int
    def __init__(self, locations: _Optional[_Iterable[_Union[BlockLocation, _Mapping]]] = ..., lease_id: _Optional[int] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("request_id", "lease_id", "ttl_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    lease_id: int
    ttl_ms: int
    def __init__(self, request_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("held",)
    HELD_FIELD_NUMBER: _ClassVar[int]
    held: bool
    def __init__(self, held: _Optional[bool] = ...) -> None: ...

class ReserveBlocksRequest(_message.Message):
    __slots__ = ("keys", "block_bytes", "checksums", "lease_request_id", "lease_ttl_ms")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    block_bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    lease_request_id: str
    lease_ttl_ms: int
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ..., block_bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., lease_request_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

class ReservedBlock(_message.Message):
    __slots__ = ("duplicate", "offset_bytes", "reservation_id")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    offset_bytes: int
    reservation_id: int
    def __init__(self, duplicate: _Optional[bool] = ..., offset_bytes: _Optional[int] = ..., reservation_id: _Optional[int] = ...) -> None: ...

class ReserveBlocksResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[ReservedBlock]
    def __init__(self, blocks: _Optional[_Iterable[_Union[ReservedBlock, _Mapping]]] = ...) -> None: ...

class CommitBlocksRequest(_message.Message):
    __slots__ = ("reservation_ids", "abort")
    RESERVATION_IDS_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    reservation_ids: _containers.RepeatedScalarFieldContainer[int]
    abort: bool
    def __init__(self, reservation_ids: _Optional[_Iterable[int]] = ..., abort: _Optional[bool] = ...) -> None: ...

class CommitBlocksResponse(_message.Message):
    __slots__ = ("num_committed_blocks",)
    NUM_COMMITTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_committed_blocks: int
    def __init__(self, num_committed_blocks: _Optional[int] = ...) -> None: ...

class ReportCorruptBlocksRequest(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedCompositeFieldContainer[_common_pb2.BlockKey]
    def __init__(self, keys: _Optional[_Iterable[_Union[_common_pb2.BlockKey, _Mapping]]] = ...) -> None: ...

class ReportCorruptBlocksResponse(_message.Message):
    __slots__ = ("num_dropped_blocks",)
    NUM_DROPPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_dropped_blocks: int
    def __init__(self, num_dropped_blocks: _Optional[int] = ...) -> None: ...
