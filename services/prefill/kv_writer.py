"""The prefill side of the KV transports: pick one for a target, open it before
computing, write the held pages with it afterwards.

The transports live as long as the service: each keeps what is worth reusing across
requests (mapped segments, opened IPC handles, gRPC channels).
"""
from __future__ import annotations

import torch

from services.kvstore.cuda_ipc import CudaIpcTransport
from services.kvstore.grpc_stream import GrpcStreamTransport
from services.kvstore.layout import PageLayout
from services.kvstore.shm_transport import SharedMemoryTransport
from services.kvstore.transport import KVDestination, PageTransport, TransportKind, choose_transport


class KVWriter:
    def __init__(self, pool: torch.Tensor, layout: PageLayout, host_id: str, *, checksum: bool = True) -> None:
        self.pool = pool  # our KV pool [L, 2, Hkv, N, bs, D]
        self.host_id = host_id
        transports = (SharedMemoryTransport(layout), GrpcStreamTransport(layout, checksum=checksum),
                      CudaIpcTransport(layout))
        self._transports: dict[TransportKind, PageTransport] = {t.kind: t for t in transports}

    def open(self, dest: KVDestination, kind: TransportKind | None) -> PageTransport:
        """The transport `kind` (None: the fastest that reaches `dest`), opened on `dest`.
        Raises what `choose_transport` and `PageTransport.open` raise."""
        if kind is None:
            kind = choose_transport(dest, own_host_id=self.host_id, is_cuda_pool=self.pool.device.type == "cuda")
        transport = self._transports[kind]
        transport.open(dest)
        return transport

    async def write(self, transport: PageTransport, request_id: str, src_blocks: list[int],
                    dest: KVDestination, start: int = 0) -> int:
        """Our held `src_blocks` into `dest.block_ids` from its `start`th (as many); returns the bytes moved."""
        return await transport.write(request_id, self.pool, src_blocks, dest,
                                     dest.block_ids[start:start + len(src_blocks)])

    async def close(self) -> None:
        """After the server stopped (no write in flight)."""
        for transport in self._transports.values():
            await transport.close()
        self.pool = None
