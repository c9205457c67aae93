from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ("reset", "num_blocks", "num_host_tier_blocks")
    RESET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HOST_TIER_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    num_blocks: int
    num_host_tier_blocks: int
    def __init__(self, reset: _Optional[bool] = ..., num_blocks: _Optional[int] = ..., num_host_tier_blocks: _Optional[int] = ...) -> None: ...
