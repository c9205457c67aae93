from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateLocallyRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_tokens", "wait_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_tokens: int
    wait_ms: int
    def __init__(self, request_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("reservation_id", "block_ids", "lease_ms", "layout", "shm_name", "transports", "host_id", "cuda_ipc_handle")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    layout: _common_pb2.KVLayout
    shm_name: str
    transports: _containers.RepeatedScalarFieldContainer[_common_pb2.KVTransport]
    host_id: str
    cuda_ipc_handle: bytes
    def __init__(self, reservation_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., shm_name: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[_common_pb2.KVTransport, str]]] = ..., host_id: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "reservation_id", "prompt_token_ids", "first_token_id", "sampling", "output_token_ids", "draft_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reservation_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token_id: int
    sampling: _common_pb2.SamplingParams
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeChunk(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finish_reason", "num_cached_tokens", "timings", "prompt_logprobs", "spec_decode")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    finish_reason: _common_pb2.FinishReason
    num_cached_tokens: int
    timings: DecodeTimings
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    spec_decode: SpecDecodeStats
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[DecodeTimings, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., spec_decode: _Optional[_Union[SpecDecodeStats, _Mapping]] = ...) -> None: ...

class SpecDecodeStats(_message.Message):
    __slots__ = ("num_spec_tokens", "rows", "per_step_drafted", "per_step_accepted")
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    num_spec_tokens: int
    rows: _containers.RepeatedCompositeFieldContainer[SpecDecodeRow]
    per_step_drafted: _containers.RepeatedScalarFieldContainer[int]
    per_step_accepted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_spec_tokens: _Optional[int] = ..., rows: _Optional[_Iterable[_Union[SpecDecodeRow, _Mapping]]] = ..., per_step_drafted: _Optional[_Iterable[int]] = ..., per_step_accepted: _Optional[_Iterable[int]] = ...) -> None: ...

class SpecDecodeRow(_message.Message):
    __slots__ = ("num_drafted", "num_steps")
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    num_drafted: int
    num_steps: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_drafted: _Optional[int] = ..., num_steps: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "finish_reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _common_pb2.FinishReason
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
