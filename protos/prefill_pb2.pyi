from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTarget(_message.Message):
    __slots__ = ("decode_address", "reservation_id", "block_ids", "transport", "shm_name", "layout", "cuda_ipc_handle", "decode_host_id", "transports", "reserve_at_once")
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DECODE_HOST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_AT_ONCE_FIELD_NUMBER: _ClassVar[int]
    decode_address: str
    reservation_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    transport: _common_pb2.KVTransport
    shm_name: str
    layout: _common_pb2.KVLayout
    cuda_ipc_handle: bytes
    decode_host_id: str
    transports: _containers.RepeatedScalarFieldContainer[_common_pb2.KVTransport]
    reserve_at_once: bool
    def __init__(self, decode_address: _Optional[str] = ..., reservation_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., transport: _Optional[_Union[_common_pb2.KVTransport, str]] = ..., shm_name: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., cuda_ipc_handle: _Optional[bytes] = ..., decode_host_id: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[_common_pb2.KVTransport, str]]] = ..., reserve_at_once: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "target", "host_tier", "output_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target: KVTarget
    host_tier: HostTierSource
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[KVTarget, _Mapping]] = ..., host_tier: _Optional[_Union[HostTierSource, _Mapping]] = ..., output_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HostTierSource(_message.Message):
    __slots__ = ("address", "num_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    num_blocks: int
    def __init__(self, address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_seconds", "prefill_seconds", "kv_transfer_seconds", "kv_transfer_bytes", "kv_transport", "host_tier_read_seconds", "admit_seconds", "received_monotonic_ns", "first_token_sent_monotonic_ns", "host_id", "kv_transfer_early_bytes")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ADMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SENT_MONOTONIC_NS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_EARLY_BYTES_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    prefill_seconds: float
    kv_transfer_seconds: float
    kv_transfer_bytes: int
    kv_transport: _common_pb2.KVTransport
    host_tier_read_seconds: float
    admit_seconds: float
    received_monotonic_ns: int
    first_token_sent_monotonic_ns: int
    host_id: str
    kv_transfer_early_bytes: int
    def __init__(self, queue_seconds: _Optional[float] = ..., prefill_seconds: _Optional[float] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transport: _Optional[_Union[_common_pb2.KVTransport, str]] = ..., host_tier_read_seconds: _Optional[float] = ..., admit_seconds: _Optional[float] = ..., received_monotonic_ns: _Optional[int] = ..., first_token_sent_monotonic_ns: _Optional[int] = ..., host_id: _Optional[str] = ..., kv_transfer_early_bytes: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "logprobs", "num_cached_tokens", "timings", "finish_reason", "reservation_id", "num_host_tier_tokens", "prompt_logprobs", "draft_token_ids")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_TIER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    logprobs: _common_pb2.TopLogprobs
    num_cached_tokens: int
    timings: PrefillTimings
    finish_reason: _common_pb2.FinishReason
    reservation_id: str
    num_host_tier_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TopLogprobs]
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first_token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_common_pb2.TopLogprobs, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., reservation_id: _Optional[str] = ..., num_host_tier_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TopLogprobs, _Mapping]]] = ..., draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "handoff")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_FIELD_NUMBER: _ClassVar[int]
    first_token: PrefillResponse
    handoff: KVHandoff
    def __init__(self, first_token: _Optional[_Union[PrefillResponse, _Mapping]] = ..., handoff: _Optional[_Union[KVHandoff, _Mapping]] = ...) -> None: ...

class KVHandoff(_message.Message):
    __slots__ = ("reservation_id", "timings")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    timings: PrefillTimings
    def __init__(self, reservation_id: _Optional[str] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ...) -> None: ...
