"""One interface for moving a request's KV pages into a decode worker's reserved pages.

A `PageTransport` is opened on a destination before prefill computes (so an unusable
one is refused early and cheaply), then writes the held source pages
`pool[:, :, :, src_blocks]` into the destination's `dst_blocks`. `choose_transport`
picks one when the caller left the choice open (DESIGN.md, "The KV cache and its
transport"): CUDA IPC between two GPU pools on one host, shared memory between two
CPU processes on one host, a gRPC stream otherwise.
"""
from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch

from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import copy_pages


class TransportKind(enum.Enum):
    SHARED_MEMORY = "SHARED_MEMORY"
    GRPC_STREAM = "GRPC_STREAM"
    CUDA_IPC = "CUDA_IPC"


class DestinationError(ValueError):
    """The destination lacks what the transport needs (a bad request, not a broken target)."""


@dataclass(frozen=True)
class KVDestination:
    """Where a request's pages go: a decode worker's reservation and the ways to reach it."""
    reservation_id: str
    block_ids: tuple[int, ...]  # the reserved pages, in prompt order
    address: str = ""           # host:port of its KVStore service (GRPC_STREAM)
    shm_name: str = ""          # its pool's segment (SHARED_MEMORY)
    cuda_ipc_handle: bytes = b""  # its pool's export (CUDA_IPC)
    host_id: str = ""           # services/kvstore/host_id.py of its host
    offered: frozenset[TransportKind] = frozenset()  # what it accepts


def choose_transport(dest: KVDestination, *, own_host_id: str, is_cuda_pool: bool) -> TransportKind:
    """The fastest transport that reaches `dest` from a pool on this host (`own_host_id`)."""
    same_host = bool(dest.host_id) and dest.host_id == own_host_id
    if same_host and is_cuda_pool and dest.cuda_ipc_handle and TransportKind.CUDA_IPC in dest.offered:
        return TransportKind.CUDA_IPC
    if same_host and dest.shm_name and TransportKind.SHARED_MEMORY in dest.offered:
        return TransportKind.SHARED_MEMORY
    if not dest.address:
        raise DestinationError("no transport reaches the decode worker: not on this host and no decode_address")
    return TransportKind.GRPC_STREAM


class PageTransport(ABC):
    """Writes held pages of one source pool (of `layout`) into destinations' reserved pages."""
    kind: TransportKind

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout

    @abstractmethod
    def open(self, dest: KVDestination) -> None:
        """Check (and map, where there is something to map) `dest` before any page is computed.
        Raises DestinationError for a destination missing what this transport needs,
        FileNotFoundError / LayoutMismatchError for a target that cannot be used."""

    @abstractmethod
    async def write(self, request_id: str, src: torch.Tensor, src_blocks: Sequence[int], dest: KVDestination,
                    dst_blocks: Sequence[int]) -> int:
        """Copy `src[:, :, :, src_blocks]` into `dst_blocks` of the opened `dest`; returns the bytes moved.
        The source pages must not change until it returns. Raises ValueError when nothing could be
        written; a transport's own errors (grpc.aio.AioRpcError) otherwise."""

    async def close(self) -> None:
        """Release what `open` mapped or connected; no write is in flight."""


class CopyTransport(PageTransport):
    """Transports whose destination pool this process maps. A small copy runs inline:
    a hop to a worker thread costs more than it (0.33 ms against 0.1 ms for a 512-token
    prompt of the demo model here). A large one runs on a worker thread (the copy
    releases the GIL, so the event loop and the engine go on meanwhile)."""

    inline_max_bytes = 8 * 2**20

    @abstractmethod
    def target_pool(self, dest: KVDestination) -> torch.Tensor:
        """The opened destination pool tensor."""

    def open(self, dest: KVDestination) -> None:
        pool = self.target_pool(dest)
        bad = next((b for b in dest.block_ids if not 0 <= b < pool.shape[3]), None)
        if bad is not None:
            raise DestinationError(f"target block id {bad} is outside the target pool [0, {pool.shape[3]})")

    def fenced(self, dest: KVDestination, dst_blocks: Sequence[int]) -> AbstractContextManager:
        """Held around a copy into `dst_blocks` of the opened `dest`: raises ValueError where they are
        no longer its reservation's (page_fence.py). Here nothing: the pool has no fence."""
        return nullcontext()

    async def write(self, request_id, src, src_blocks, dest, dst_blocks) -> int:
        args = (src, list(src_blocks), self.target_pool(dest), list(dst_blocks))
        block_bytes = src[:, :, :, 0].numel() * src.element_size()
        with self.fenced(dest, dst_blocks):
            if len(src_blocks) * block_bytes <= self.inline_max_bytes:
                return copy_pages(*args)
            return await asyncio.to_thread(copy_pages, *args)
