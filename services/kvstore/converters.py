"""Pages ↔ kvstore.proto PageChunk: building chunks from a pool, and checking received ones.

Every received chunk is checked on its own (layout, layer range, checksum, length)
before a byte of it is used; the caller checks the block ids it names.
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import torch

from protos import kvstore_pb2
from services.common.converters import layout_from_proto, layout_to_proto
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_chunks import ChunkSpec, chunk_view, gather_chunk


class ChecksumError(ValueError):
    """A chunk's bytes are not the bytes its sender checksummed."""


def chunk_to_proto(pool: torch.Tensor, layout: PageLayout, spec: ChunkSpec, src_blocks: Sequence[int], *,
                   request_id: str, reservation_id: str = "", dst_blocks: Sequence[int] = (),
                   block_hashes: Sequence[int] = (), checksum: bool = True,
                   staging: torch.Tensor | None = None) -> kvstore_pb2.PageChunk:
    """The chunk `spec` of `pool[:, :, :, src_blocks]`, named by `dst_blocks` (in a reservation) or
    `block_hashes` (in the host tier), each indexed like `src_blocks`. `staging`: see gather_chunk."""
    pages = gather_chunk(pool, src_blocks[spec.first : spec.last], spec.layer_start, spec.layer_end, staging)
    return pages_to_proto(pages, layout, spec.layer_start, request_id=request_id, reservation_id=reservation_id,
                          block_ids=dst_blocks[spec.first : spec.last],
                          block_hashes=block_hashes[spec.first : spec.last], checksum=checksum)


def pages_to_proto(pages: torch.Tensor, layout: PageLayout, layer_start: int, *, request_id: str,
                   reservation_id: str = "", block_ids: Sequence[int] = (), block_hashes: Sequence[int] = (),
                   checksum: bool = True) -> kvstore_pb2.PageChunk:
    """A chunk of gathered pages: contiguous uint8 `[l, 2*Hkv, nb, bs*D*itemsize]` from `layer_start`."""
    raw = pages.numpy().tobytes()  # protobuf takes only bytes: one copy, whatever we hand it
    chunk = kvstore_pb2.PageChunk(
        request_id=request_id, layout=layout_to_proto(layout), reservation_id=reservation_id,
        block_ids=block_ids, block_hashes=block_hashes, layer_start=layer_start,
        layer_end=layer_start + pages.shape[0], data=raw)
    if checksum:
        chunk.checksum = zlib.crc32(raw)
    return chunk


@dataclass(frozen=True)
class ReceivedChunk:
    layout: PageLayout  # the sender's (num_blocks = the chunk's)
    layer_start: int
    layer_end: int
    block_ids: list[int]
    block_hashes: list[int]
    pages: torch.Tensor  # uint8 [l, 2*Hkv, nb, bs*D*itemsize], a view over the message's bytes

    @property
    def num_bytes(self) -> int:
        return self.pages.numel()


def chunk_from_proto(chunk: kvstore_pb2.PageChunk, expected: PageLayout | None) -> ReceivedChunk:
    """Check a received chunk against `expected` (None: take the sender's layout as it is).

    Raises LayoutMismatchError (another model or shape), ChecksumError (corrupted bytes),
    or ValueError (no pages named, both kinds of names, a bad layer range, a wrong length).
    The returned view is over `chunk.data` as read once: each read of a protobuf bytes field copies it out of the
    message (a 2 MiB chunk's copies were most of a stream's time)."""
    num_blocks = len(chunk.block_ids) or len(chunk.block_hashes)
    if chunk.block_ids and chunk.block_hashes:
        raise ValueError("a chunk names its pages by block_ids or by block_hashes, not both")
    if num_blocks == 0:
        raise ValueError("a chunk must name at least one block (block_ids or block_hashes)")
    if not chunk.HasField("layout"):
        raise LayoutMismatchError("the chunk carries no KV layout")
    try:
        layout = layout_from_proto(chunk.layout, num_blocks=num_blocks)
    except ValueError as e:
        raise LayoutMismatchError(f"the chunk's KV layout is not valid: {e}") from None
    if expected is not None:
        expected.check_compatible(layout)
    if not 0 <= chunk.layer_start < chunk.layer_end <= layout.num_layers:
        raise ValueError(f"layer range [{chunk.layer_start}, {chunk.layer_end}) is not inside "
                         f"[0, {layout.num_layers})")
    data = chunk.data
    if chunk.HasField("checksum") and zlib.crc32(data) != chunk.checksum:
        raise ChecksumError(f"chunk of layers [{chunk.layer_start}, {chunk.layer_end}) failed its CRC-32 check")
    pages = chunk_view(data, layout, chunk.layer_end - chunk.layer_start, num_blocks)
    return ReceivedChunk(layout, chunk.layer_start, chunk.layer_end, list(chunk.block_ids),
                         list(chunk.block_hashes), pages)


async def chunk_or_abort(chunk: kvstore_pb2.PageChunk, expected: PageLayout | None, context,
                         mismatch: str) -> ReceivedChunk:
    """`chunk_from_proto` for a servicer: a refused chunk ends the call with the status
    kvstore.proto names (FAILED_PRECONDITION prefixed by `mismatch`, DATA_LOSS, INVALID_ARGUMENT)."""
    try:
        return chunk_from_proto(chunk, expected)
    except LayoutMismatchError as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{mismatch}: {e}")
    except ChecksumError as e:
        await context.abort(grpc.StatusCode.DATA_LOSS, str(e))
    except ValueError as e:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
