from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("model_path",)
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    def __init__(self, model_path: _Optional[str] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("updated", "num_blocks", "num_host_tier_blocks", "seconds")
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    updated: bool
    num_blocks: int
    num_host_tier_blocks: int
    seconds: float
    def __init__(self, updated: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_host_tier_blocks: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
