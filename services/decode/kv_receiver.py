"""The KVStore gRPC service (protos/kvstore.proto) on a decode worker: pages sent over
GRPC_STREAM land in the reserved pages of its pool, on the same port as Decode.

Each chunk is checked on its own, then copied in: layout and model fingerprint
(FAILED_PRECONDITION), checksum (DATA_LOSS), a reservation that is live and held for
this request (NOT_FOUND), block ids all inside it and a data length that fits
(INVALID_ARGUMENT). The reservation check and the copy run without an await between
them on the event loop, where leases expire and Decode claims them: a page freed or
handed to Decode in the meantime is never written. Each chunk written renews the lease: a
prefill worker may send a long prompt's pages as they are computed, over several streams. A
refused stream leaves the pages it wrote reserved; Abort or the lease frees them as for any
reservation.
ReadPages is the host tier's (a kvstore node), not a decode worker's: UNIMPLEMENTED.
"""
from __future__ import annotations

import grpc
import torch

from protos import kvstore_pb2, kvstore_pb2_grpc
from services.common.stream_refusal import RefusingAfterStream
from services.decode.leases import LeaseTable
from services.kvstore.converters import chunk_or_abort
from services.kvstore.layout import PageLayout
from services.kvstore.page_chunks import scatter_chunk

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name


class KVReceiver(kvstore_pb2_grpc.KVStoreServicer):
    """`attach` is called once the pool and the leases exist; until then every call is UNAVAILABLE."""

    def __init__(self) -> None:
        self.pool: torch.Tensor | None = None  # [L, 2, Hkv, N, bs, D], in shared memory
        self.layout: PageLayout | None = None
        self.leases: LeaseTable | None = None

    def attach(self, pool: torch.Tensor, layout: PageLayout, leases: LeaseTable) -> None:
        self.pool, self.layout, self.leases = pool, layout, leases

    def close(self) -> None:
        """Drop the pool view, so the segment can be unmapped."""
        self.pool = None

    async def WritePages(self, request_iterator, context):
        context = RefusingAfterStream(context, request_iterator)
        if self.pool is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the decode worker is still loading")
        num_chunks = num_bytes = 0
        async for chunk in request_iterator:
            received = await chunk_or_abort(chunk, self.layout, context,
                                            "the pages do not fit this decode worker's pool")
            if received.block_hashes:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "a decode worker takes pages into a reservation (block_ids), not by block hash")
            lease = self.leases.get(chunk.reservation_id)
            if lease is None or (chunk.request_id and chunk.request_id != lease.request_id):
                await context.abort(grpc.StatusCode.NOT_FOUND,
                                    f"no reservation {chunk.reservation_id!r} for request {chunk.request_id!r} "
                                    "(unknown, expired or already claimed by Decode)")
            outside = sorted(set(received.block_ids) - lease.block_ids)
            if outside:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"block ids {outside} are not reserved under {chunk.reservation_id!r}")
            if len(set(received.block_ids)) != len(received.block_ids):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the chunk's block_ids have duplicates")
            scatter_chunk(self.pool, received.block_ids, received.layer_start, received.pages)
            self.leases.renew(lease)
            num_chunks += 1
            num_bytes += received.num_bytes
        return kvstore_pb2.WriteAck(num_chunks=num_chunks, num_bytes=num_bytes)

    async def ReadPages(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "a decode worker holds no host tier; read pages from a kvstore node")
