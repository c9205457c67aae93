from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    MEMORY_KIND_WEIGHTS: _ClassVar[MemoryKind]
    MEMORY_KIND_KV_CACHE: _ClassVar[MemoryKind]

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_IN_PLACE: _ClassVar[PauseMode]
    PAUSE_MODE_RETRACT: _ClassVar[PauseMode]
MEMORY_KIND_UNSPECIFIED: MemoryKind
MEMORY_KIND_WEIGHTS: MemoryKind
MEMORY_KIND_KV_CACHE: MemoryKind
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_IN_PLACE: PauseMode
PAUSE_MODE_RETRACT: PauseMode

class MemoryRequest(_message.Message):
    __slots__ = ("kinds",)
    KINDS_FIELD_NUMBER: _ClassVar[int]
    kinds: _containers.RepeatedScalarFieldContainer[MemoryKind]
    def __init__(self, kinds: _Optional[_Iterable[_Union[MemoryKind, str]]] = ...) -> None: ...

class ReleaseMemoryResponse(_message.Message):
    __slots__ = ("bytes_released",)
    BYTES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    bytes_released: int
    def __init__(self, bytes_released: _Optional[int] = ...) -> None: ...

class ResumeMemoryResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PauseRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: PauseMode
    def __init__(self, mode: _Optional[_Union[PauseMode, str]] = ...) -> None: ...

class PauseResponse(_message.Message):
    __slots__ = ("num_running",)
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    def __init__(self, num_running: _Optional[int] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResumeResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SchedulerInfo(_message.Message):
    __slots__ = ("model", "dtype", "kv_cache_dtype", "block_size", "num_kv_blocks", "num_free_blocks", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "scheduling_policy", "enable_prefix_caching", "num_running", "num_waiting", "is_paused", "num_preemptions", "num_speculative_tokens", "num_drafts", "num_accepted_tokens", "released_memory", "speculative_method")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    SCHEDULING_POLICY_FIELD_NUMBER: _ClassVar[int]
    ENABLE_PREFIX_CACHING_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    IS_PAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_METHOD_FIELD_NUMBER: _ClassVar[int]
    model: str
    dtype: str
    kv_cache_dtype: str
    block_size: int
    num_kv_blocks: int
    num_free_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    scheduling_policy: str
    enable_prefix_caching: bool
    num_running: int
    num_waiting: int
    is_paused: bool
    num_preemptions: int
    num_speculative_tokens: int
    num_drafts: int
    num_accepted_tokens: int
    released_memory: _containers.RepeatedScalarFieldContainer[MemoryKind]
    speculative_method: str
    def __init__(self, model: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_cache_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., max_model_len: _Optional[int] = ..., scheduling_policy: _Optional[str] = ..., enable_prefix_caching: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., is_paused: _Optional[bool] = ..., num_preemptions: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., num_drafts: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ..., released_memory: _Optional[_Iterable[_Union[MemoryKind, str]]] = ..., speculative_method: _Optional[str] = ...) -> None: ...
