"""Whether a request's KV target can take this worker's pages, and the transport opened to it.

Checked before computing where the request names a reservation, else once the decode worker
has reserved the pages; a target that cannot be used aborts the call with the status code
the servicer's docstring gives for it (INVALID_ARGUMENT or FAILED_PRECONDITION).
"""
from __future__ import annotations

import grpc

from protos import prefill_pb2
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.transport import KVDestination, PageTransport
from services.prefill.converters import destination_from_proto, layout_from_proto, transport_from_proto
from services.prefill.kv_writer import KVWriter


async def open_target(layout: PageLayout, writer: KVWriter, target: prefill_pb2.KVTarget, num_blocks: int,
                      context) -> tuple[PageTransport, KVDestination]:
    """The opened transport to the target's first `num_blocks` pages; aborts the call if unusable.
    `layout` and `writer`: this worker's."""
    if not target.HasField("layout"):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target.layout must be set")
    try:
        layout.check_compatible(layout_from_proto(target.layout, num_blocks=1))
    except ValueError as e:  # LayoutMismatchError, or a layout that is not one at all
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"the KV target does not match this prefill worker: {e}")
    if len(target.block_ids) < num_blocks:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"the prompt needs {num_blocks} KV blocks, the target has {len(target.block_ids)}")
    dest = destination_from_proto(target, num_blocks)
    if len(set(dest.block_ids)) != len(dest.block_ids):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "target.block_ids has duplicates")
    try:
        return writer.open(dest, transport_from_proto(target.transport)), dest
    except (FileNotFoundError, LayoutMismatchError) as e:
        await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"cannot attach the KV target: {e}")
    except ValueError as e:  # DestinationError, or a transport this build does not know
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot use the KV target: {e}")
