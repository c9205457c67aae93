"""A worker's request with a prompt's images' pixels and its embeddings' rows spliced into its bytes, and the
workers' stubs that take a request as its bytes.

The gateway's params carry each image without its pixels, and a prompt's embeddings without their rows
(given_embeddings.py's `given_to`s); only a request that prefills the prompt needs them, and gets them here:
its message made and serialized without them (a few KB), the pixels and rows joined in after, as protobuf
frames them (a repeated field's elements are frames one after another; a singular message field's frames are
merged; a message's fields may come in any order). Pixels put into messages (a Qwen-VL image's are up to
38 MB), copied into the worker's request and serialized with it had held the event loop 168 ms for one such
image here, every other stream it serves waiting: protobuf holds the GIL through each copy, so a thread did
not help (bench/gateway_loop_images.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

from protos import common_pb2, decode_pb2, prefill_pb2
from services.gateway.given_embeddings import EmbeddedImage, GivenImages, GivenRows

_LENGTH_DELIMITED = 2
_IMAGES = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["images"].number
_PROMPT_EMBEDS = common_pb2.SamplingParams.DESCRIPTOR.fields_by_name["prompt_embeds"].number
_RGB = common_pb2.PromptImage.DESCRIPTOR.fields_by_name["rgb"].number
_EMBEDS = common_pb2.PromptImage.DESCRIPTOR.fields_by_name["embeds"].number
_DATA = common_pb2.PromptEmbeds.DESCRIPTOR.fields_by_name["data"].number


@dataclass(frozen=True)
class BulkInputs:
    """What a request's params carry without its bytes: its images' pixels, its prompt embeddings' rows."""

    images: GivenImages | None = None
    rows: GivenRows | None = None


def with_inputs(request: Message, bulk: BulkInputs | None) -> Message | bytes:
    """`request`, whose `sampling` carries `bulk` without its bytes, as a worker that prefills its prompt
    takes it: its bytes, each image's pixels and the embeddings' rows in their frames; `request` itself
    where there are none."""
    if bulk is None:
        return request
    head = type(request)()
    head.CopyFrom(request)  # its params' images and embeddings are a few numbers each
    head.ClearField("sampling")
    sampling = common_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    metas = list(sampling.images)
    sampling.ClearField("images")
    parts = [sampling.SerializeToString()]
    for meta, image in zip(metas, bulk.images.sent if bulk.images is not None else (), strict=True):
        rest = meta.SerializeToString()
        if isinstance(image, EmbeddedImage):  # its rows in a frame of `embeds`, which merges with the rest's
            data = image.rows
            data_frame = _frame_head(_DATA, len(data))
            data_head = _frame_head(_EMBEDS, len(data_frame) + len(data)) + data_frame
        else:
            data = image.rgb
            data_head = _frame_head(_RGB, len(data))
        parts += [_frame_head(_IMAGES, len(data_head) + len(data) + len(rest)), data_head, data, rest]
    if bulk.rows is not None:  # merged into the embeddings' frame above, which has the rest
        rows = bulk.rows.rows
        rows_frame = _frame_head(_DATA, len(rows))
        parts += [_frame_head(_PROMPT_EMBEDS, len(rows_frame) + len(rows)), rows_frame, rows]
    sampling_size = sum(len(part) for part in parts)
    number = type(request).DESCRIPTOR.fields_by_name["sampling"].number
    return b"".join([head.SerializeToString(), _frame_head(number, sampling_size), *parts])


def _frame_head(field_number: int, size: int) -> bytes:
    """A length-delimited field's tag and length, as protobuf writes them (varints)."""
    return _varint(field_number << 3 | _LENGTH_DELIMITED) + _varint(size)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _serialized(request: Message | bytes) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def stub_taking_bytes(stub_class: Callable[[grpc.aio.Channel], Any], service_name: str
                      ) -> Callable[[grpc.aio.Channel], Any]:
    """`stub_class`'s maker, whose methods take a request as a message or as its bytes (`with_inputs`').
    `service_name`: its service's full name in the protos ("baton.prefill.v1.Prefill")."""
    service = _SERVICES[service_name]
    kinds = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
             (True, True): "stream_stream"}

    def make(channel: grpc.aio.Channel) -> Any:
        stub = stub_class(channel)
        for method in service.methods:
            callable_of = getattr(channel, kinds[method.client_streaming, method.server_streaming])
            setattr(stub, method.name, callable_of(f"/{service.full_name}/{method.name}",
                                                   request_serializer=_serialized,
                                                   response_deserializer=GetMessageClass(method.output_type).FromString))
        return stub
    return make


_SERVICES = {service.full_name: service for module in (prefill_pb2, decode_pb2)
             for service in module.DESCRIPTOR.services_by_name.values()}
