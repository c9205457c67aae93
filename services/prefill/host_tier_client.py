"""A prefill worker's side of the host page tier (a kvstore node, services/kvstore/servicer.py):
read a prefix's blocks back instead of computing them, and store the blocks it computed.

Both directions name blocks by their chained hash (engine/block_hash.py), so a block
read back is exactly the prompt prefix the hash names, whoever computed it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.dtypes import TORCH_DTYPES
from protos import cache_pb2, cache_pb2_grpc, kvstore_pb2
from services.common.converters import layout_to_proto
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES
from services.kvstore.converters import chunk_from_proto
from services.kvstore.grpc_stream import GrpcStreamSender
from services.kvstore.layout import PageLayout
from services.kvstore.page_chunks import scatter_chunk


class HostTierClient:
    """Channels to kvstore nodes, one per address (reads and writes share it), kept for the
    worker's life. `close` on the event loop that used it."""

    def __init__(self, layout: PageLayout, *, checksum: bool = True, read_timeout_s: float = 2.0,
                 write_timeout_s: float = 30.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.layout = layout  # of our pool: what we read must match it, what we write carries it
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self._sender = GrpcStreamSender(layout, checksum=checksum, max_message_bytes=max_message_bytes)

    async def read(self, address: str, block_hashes: Sequence[int], request_id: str) -> torch.Tensor:
        """The longest prefix of `block_hashes` the node holds, as a pool `[L, 2, Hkv, n, bs, D]`
        (n may be 0). Raises grpc.aio.AioRpcError, or ValueError for a chunk that fails its
        checks or names blocks that were not asked for."""
        position = {h: i for i, h in enumerate(block_hashes)}
        query = kvstore_pb2.PageQuery(request_id=request_id, layout=layout_to_proto(self.layout.with_num_blocks(1)),
                                      block_hashes=block_hashes)
        pages = torch.empty(self.layout.with_num_blocks(max(1, len(block_hashes))).shape,
                            dtype=TORCH_DTYPES[self.layout.dtype])
        filled = torch.zeros((self.layout.num_layers, len(block_hashes)), dtype=torch.bool)
        call = self._sender.stub(address).ReadPages(query, timeout=self.read_timeout_s)
        async for chunk in call:
            received = chunk_from_proto(chunk, self.layout.with_num_blocks(1))
            try:
                blocks = [position[h] for h in received.block_hashes]
            except KeyError as e:
                raise ValueError(f"the kvstore node sent block {e.args[0]:#x}, which was not asked for") from None
            scatter_chunk(pages, blocks, received.layer_start, received.pages)
            filled[received.layer_start : received.layer_end, blocks] = True
        # The node streams a prefix of the query; only blocks with every layer count.
        complete = filled.all(dim=0).tolist()
        n = complete.index(False) if False in complete else len(complete)
        return pages if n == pages.shape[3] else pages[:, :, :, :n].contiguous()

    async def write(self, address: str, pool: torch.Tensor, blocks: Sequence[int], block_hashes: Sequence[int],
                    request_id: str) -> int:
        """Store `pool[..., blocks]` on the node under `block_hashes`; returns the bytes sent.
        The pages must stay unchanged until it returns."""
        return await self._sender.write(address, pool, blocks, request_id=request_id, block_hashes=block_hashes,
                                        timeout_s=self.write_timeout_s)

    async def reset(self, address: str) -> int:
        """Have the node forget every block it stores (a prefix-cache reset); the number forgotten."""
        stub = cache_pb2_grpc.PrefixCacheStub(self._sender.channel(address))
        return (await stub.Reset(cache_pb2.ResetPrefixCacheRequest(), timeout=self.read_timeout_s)).num_blocks

    async def close(self) -> None:
        await self._sender.close()
