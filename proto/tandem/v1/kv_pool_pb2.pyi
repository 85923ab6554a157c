from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LookupRequest(_message.Message):
    __slots__ = ("spec_fingerprint", "block_hashes")
    SPEC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    spec_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, spec_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("num_hit_blocks",)
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_hit_blocks: int
    def __init__(self, num_hit_blocks: _Optional[int] = ...) -> None: ...

class AcquireLeaseRequest(_message.Message):
    __slots__ = ("spec_fingerprint", "block_hashes", "request_id", "ttl_ms")
    SPEC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    spec_fingerprint: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    request_id: str
    ttl_ms: int
    def __init__(self, spec_fingerprint: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., request_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class AcquireLeaseResponse(_message.Message):
    __slots__ = ("num_hit_blocks",)
    NUM_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_hit_blocks: int
    def __init__(self, num_hit_blocks: _Optional[int] = ...) -> None: ...

class PutBlocksRequest(_message.Message):
    __slots__ = ("key", "block_bytes", "offset_bytes", "data", "lease_request_id", "lease_ttl_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LEASE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    key: _common_pb2.BlockKey
    block_bytes: int
    offset_bytes: int
    data: bytes
    lease_request_id: str
    lease_ttl_ms: int
    def __init__(self, key: _Optional[_Union[_common_pb2.BlockKey, _Mapping]] = ..., block_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ..., lease_request_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("key_index", "block_bytes", "offset_bytes", "data")
    KEY_INDEX_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key_index: int
    block_bytes: int
    offset_bytes: int
    data: bytes
    def __init__(self, key_index: _Optional[int] = ..., block_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

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
    __slots__ = ("capacity_bytes", "used_bytes", "num_writing_blocks", "num_stored_blocks", "num_leased_blocks", "num_scoped_blocks", "num_leases", "num_evicted_blocks", "num_lookup_hit_blocks", "num_lookup_blocks")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCOPED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOOKUP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    used_bytes: int
    num_writing_blocks: int
    num_stored_blocks: int
    num_leased_blocks: int
    num_scoped_blocks: int
    num_leases: int
    num_evicted_blocks: int
    num_lookup_hit_blocks: int
    num_lookup_blocks: int
    def __init__(self, capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., num_writing_blocks: _Optional[int] = ..., num_stored_blocks: _Optional[int] = ..., num_leased_blocks: _Optional[int] = ..., num_scoped_blocks: _Optional[int] = ..., num_leases: _Optional[int] = ..., num_evicted_blocks: _Optional[int] = ..., num_lookup_hit_blocks: _Optional[int] = ..., num_lookup_blocks: _Optional[int] = ...) -> None: ...
