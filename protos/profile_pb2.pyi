from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class StartProfileRequest(_message.Message):
    __slots__ = ("record_shapes", "with_stack")
    RECORD_SHAPES_FIELD_NUMBER: _ClassVar[int]
    WITH_STACK_FIELD_NUMBER: _ClassVar[int]
    record_shapes: bool
    with_stack: bool
    def __init__(self, record_shapes: _Optional[bool] = ..., with_stack: _Optional[bool] = ...) -> None: ...

class StartProfileResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StopProfileResponse(_message.Message):
    __slots__ = ("trace_path",)
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    trace_path: str
    def __init__(self, trace_path: _Optional[str] = ...) -> None: ...
