from tandem.v1 import common_pb2 as _common_pb2
from tandem.v1 import prefill_worker_pb2 as _prefill_worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DropManifestRequest(_message.Message):
    __slots__ = ("request_id", "manifest")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    manifest: _common_pb2.KVManifest
    def __init__(self, request_id: _Optional[str] = ..., manifest: _Optional[_Union[_common_pb2.KVManifest, _Mapping]] = ...) -> None: ...

class DropManifestResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "first_token_id", "sampling_params", "manifest", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling_params: _common_pb2.SamplingParams
    manifest: _common_pb2.KVManifest
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., manifest: _Optional[_Union[_common_pb2.KVManifest, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("tokens", "finished", "started")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    tokens: TokenChunk
    finished: Finished
    started: Started
    def __init__(self, tokens: _Optional[_Union[TokenChunk, _Mapping]] = ..., finished: _Optional[_Union[Finished, _Mapping]] = ..., started: _Optional[_Union[Started, _Mapping]] = ...) -> None: ...

class Started(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "prompt_logprobs", "num_cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class Finished(_message.Message):
    __slots__ = ("finish_reason", "num_output_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    num_output_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_output_tokens: _Optional[int] = ...) -> None: ...
