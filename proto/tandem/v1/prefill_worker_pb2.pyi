from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "num_cached_tokens", "manifest", "prefill_time_s", "first_token_logprob", "prompt_logprobs")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIME_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    num_cached_tokens: int
    manifest: _common_pb2.KVManifest
    prefill_time_s: float
    first_token_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, first_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., manifest: _Optional[_Union[_common_pb2.KVManifest, _Mapping]] = ..., prefill_time_s: _Optional[float] = ..., first_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetWorkerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetWorkerStatsResponse(_message.Message):
    __slots__ = ("num_requests_running", "num_requests_waiting", "num_total_blocks", "num_used_blocks", "num_free_blocks", "num_prefill_tokens", "num_cached_tokens", "num_generated_tokens", "num_batched_tokens", "num_waiting_tokens", "num_kv_tokens", "recent_step_time_s", "max_num_seqs", "cost_base_s", "cost_per_token_s", "cost_per_seq_s", "cost_per_attn_s", "cost_num_samples", "cost_max_num_batched_tokens", "cost_kv_load_bytes_per_s", "cost_kv_bytes_per_token")
    NUM_REQUESTS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RECENT_STEP_TIME_S_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    COST_BASE_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_SEQ_S_FIELD_NUMBER: _ClassVar[int]
    COST_PER_ATTN_S_FIELD_NUMBER: _ClassVar[int]
    COST_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COST_MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COST_KV_LOAD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    COST_KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    num_requests_running: int
    num_requests_waiting: int
    num_total_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_prefill_tokens: int
    num_cached_tokens: int
    num_generated_tokens: int
    num_batched_tokens: int
    num_waiting_tokens: int
    num_kv_tokens: int
    recent_step_time_s: float
    max_num_seqs: int
    cost_base_s: float
    cost_per_token_s: float
    cost_per_seq_s: float
    cost_per_attn_s: float
    cost_num_samples: int
    cost_max_num_batched_tokens: int
    cost_kv_load_bytes_per_s: float
    cost_kv_bytes_per_token: float
    def __init__(self, num_requests_running: _Optional[int] = ..., num_requests_waiting: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_prefill_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_batched_tokens: _Optional[int] = ..., num_waiting_tokens: _Optional[int] = ..., num_kv_tokens: _Optional[int] = ..., recent_step_time_s: _Optional[float] = ..., max_num_seqs: _Optional[int] = ..., cost_base_s: _Optional[float] = ..., cost_per_token_s: _Optional[float] = ..., cost_per_seq_s: _Optional[float] = ..., cost_per_attn_s: _Optional[float] = ..., cost_num_samples: _Optional[int] = ..., cost_max_num_batched_tokens: _Optional[int] = ..., cost_kv_load_bytes_per_s: _Optional[float] = ..., cost_kv_bytes_per_token: _Optional[float] = ...) -> None: ...
