from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PauseMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAUSE_MODE_UNSPECIFIED: _ClassVar[PauseMode]
    PAUSE_MODE_IN_PLACE: _ClassVar[PauseMode]
    PAUSE_MODE_RETRACT: _ClassVar[PauseMode]
PAUSE_MODE_UNSPECIFIED: PauseMode
PAUSE_MODE_IN_PLACE: PauseMode
PAUSE_MODE_RETRACT: PauseMode

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
