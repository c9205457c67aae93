from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PageChunk(_message.Message):
    __slots__ = ("request_id", "layout", "reservation_id", "block_ids", "block_hashes", "layer_start", "layer_end", "data", "checksum")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: _common_pb2.KVLayout
    reservation_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    data: bytes
    checksum: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., reservation_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ...) -> None: ...

class WriteAck(_message.Message):
    __slots__ = ("num_chunks", "num_bytes")
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_chunks: int
    num_bytes: int
    def __init__(self, num_chunks: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class PageQuery(_message.Message):
    __slots__ = ("request_id", "layout", "block_hashes", "layer_start", "layer_end")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: _common_pb2.KVLayout
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    layer_start: int
    layer_end: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[_common_pb2.KVLayout, _Mapping]] = ..., block_hashes: _Optional[_Iterable[int]] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ...) -> None: ...
