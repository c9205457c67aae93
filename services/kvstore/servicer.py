"""The KVStore gRPC service (protos/kvstore.proto) of a kvstore node: the host tier.

WritePages takes blocks named by hash; a stream's blocks are kept only once the
whole stream arrived and every block has every layer (a half-written block must
never be read as a prefix). ReadPages streams the longest stored prefix of the
queried hashes, in chunks of at most 2 MiB.

Status codes:
- FAILED_PRECONDITION: a chunk's layout is not valid or differs from the stream's
  first one, or a stored block's layout differs from the query's.
- DATA_LOSS: a chunk failed its checksum.
- INVALID_ARGUMENT: pages named by reservation block ids, a bad layer range, a data
  length that does not fit, a block missing layers at the end of the stream, an
  invalid query layout or layer range.
- RESOURCE_EXHAUSTED: a stream (or one block) larger than the whole capacity.
"""
from __future__ import annotations

import logging

import grpc
import torch

from protos import cache_pb2, cache_pb2_grpc, kvstore_pb2, kvstore_pb2_grpc
from services.common.converters import layout_from_proto
from services.common.stream_refusal import RefusingAfterStream
from services.kvstore.converters import chunk_or_abort, pages_to_proto
from services.kvstore.disk_tier import DiskPageTier
from services.kvstore.host_tier import HostPageTier, StoredBlock
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_chunks import plan_chunks

SERVICE_NAME = kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].full_name
log = logging.getLogger("baton.kvstore")


class _StagedBlock:
    """One block of a write stream, filled layer range by layer range."""

    def __init__(self, layout: PageLayout, row_bytes: int) -> None:
        self.pages = torch.empty((layout.num_layers, 2 * layout.num_kv_heads, row_bytes), dtype=torch.uint8)
        self.layers = [False] * layout.num_layers

    def missing_layers(self) -> list[int]:
        return [i for i, filled in enumerate(self.layers) if not filled]


class KVStoreNodeServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, capacity_bytes: int, disk: DiskPageTier | None = None) -> None:
        self.tier = HostPageTier(capacity_bytes, disk)

    async def WritePages(self, request_iterator, context):
        context = RefusingAfterStream(context, request_iterator)
        layout: PageLayout | None = None  # the stream's, from its first chunk
        staged: dict[int, _StagedBlock] = {}
        num_chunks = num_bytes = 0
        async for chunk in request_iterator:
            received = await chunk_or_abort(chunk, layout, context, "refused KV layout")
            if received.block_ids:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    "a kvstore node stores pages by block hash, not reservation block ids")
            layout = layout or received.layout.with_num_blocks(1)
            num_bytes += received.num_bytes
            if num_bytes > self.tier.capacity_bytes:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the stream is over this node's capacity of {self.tier.capacity_bytes} bytes")
            for i, block_hash in enumerate(received.block_hashes):
                block = staged.get(block_hash)
                if block is None:
                    block = staged[block_hash] = _StagedBlock(layout, received.pages.shape[3])
                block.pages[received.layer_start : received.layer_end].copy_(received.pages[:, :, i])
                block.layers[received.layer_start : received.layer_end] = [True] * (
                    received.layer_end - received.layer_start)
            num_chunks += 1
        for block_hash, block in staged.items():
            missing = block.missing_layers()
            if missing:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"block {block_hash:#x} is missing layers {missing}; nothing was stored")
        for block_hash, block in staged.items():
            self.tier.put(block_hash, StoredBlock(layout, block.pages))
        return kvstore_pb2.WriteAck(num_chunks=num_chunks, num_bytes=num_bytes)

    async def ReadPages(self, request, context):
        try:
            layout = layout_from_proto(request.layout, num_blocks=1)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the query's KV layout is not valid: {e}")
        layer_end = request.layer_end or layout.num_layers
        blocks = await self.tier.longest_prefix(layout.fingerprint, list(request.block_hashes))
        try:
            for block in blocks:
                layout.check_compatible(block.layout)
            specs = plan_chunks(layout, len(blocks), request.layer_start, layer_end)
        except LayoutMismatchError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"the stored pages are another layout: {e}")
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        hashes = request.block_hashes[: len(blocks)]
        for spec in specs:
            # [l, 2*Hkv, nb, row]: the blocks side by side, as a pool's pages are
            pages = torch.stack([b.pages[spec.layer_start : spec.layer_end] for b in blocks[spec.first : spec.last]],
                                dim=2)
            yield pages_to_proto(pages, layout, spec.layer_start, request_id=request.request_id,
                                 block_hashes=hashes[spec.first : spec.last])


class HostTierCacheServicer(cache_pb2_grpc.PrefixCacheServicer):
    """The node's PrefixCache service: a reset forgets every block the tier stores (a prefill worker
    asks it, with its own, at the gateway's `/reset_prefix_cache`)."""

    def __init__(self, tier: HostPageTier) -> None:
        self.tier = tier

    async def Reset(self, request: cache_pb2.ResetPrefixCacheRequest, context) -> cache_pb2.ResetPrefixCacheResponse:
        return cache_pb2.ResetPrefixCacheResponse(reset=True, num_blocks=self.tier.clear())
