"""The CUDA_IPC transport: same host, GPU pools. The decode worker exports its pool's
CUDA IPC handle; prefill opens it once and copies pages device to device, each copy fenced
as a shared-memory copy is (page_fence.py) by the pool's fence segment, which the handle names
(fence_segment.py).

The handle is torch's own export (`torch.multiprocessing.reductions.reduce_tensor`,
i.e. the storage's `_share_cuda_()`), written as JSON rather than pickled: it crosses
the network inside a Reservation, and unpickling what a peer sent runs its code.
Opening one's own export in the same process is refused by CUDA; open it in another.
This module imports without CUDA; using it without CUDA raises DestinationError.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from services.kvstore.fence_segment import FenceSegment
from services.kvstore.layout import LayoutMismatchError, PageLayout
from services.kvstore.page_copy import copy_pages
from services.kvstore.transport import CopyTransport, DestinationError, KVDestination, TransportKind

FORMAT = "baton-cuda-ipc/2"
_BYTES_FIELDS = ("storage_handle", "ref_counter_handle", "event_handle")


def export_handle(pool: torch.Tensor, fence_name: str) -> bytes:
    """The IPC handle of a CUDA pool tensor whose pages' fence is segment `fence_name`, as bytes to put in
    a Reservation."""
    from torch.multiprocessing.reductions import reduce_tensor

    if pool.device.type != "cuda":
        raise ValueError(f"only a CUDA tensor has a CUDA IPC handle, got one on {pool.device}")
    _, (_, size, stride, offset, _, dtype, device, storage_handle, storage_size_bytes, storage_offset_bytes, _,
        ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = reduce_tensor(pool)
    fields = {
        "format": FORMAT, "size": list(size), "stride": list(stride), "offset": offset,
        "dtype": str(dtype).removeprefix("torch."), "device": device,
        "storage_handle": storage_handle, "storage_size_bytes": storage_size_bytes,
        "storage_offset_bytes": storage_offset_bytes, "ref_counter_handle": ref_counter_handle,
        "ref_counter_offset": ref_counter_offset, "event_handle": event_handle,
        "event_sync_required": event_sync_required, "fence": fence_name,
    }
    for name in _BYTES_FIELDS:
        fields[name] = None if fields[name] is None else fields[name].hex()
    return json.dumps(fields).encode()


class OpenedPool(NamedTuple):
    tensor: torch.Tensor
    fence_segment: FenceSegment


def open_handle(handle: bytes, layout: PageLayout) -> OpenedPool:
    """The pool tensor another process exported, mapped into this one, and its fence. Raises ValueError
    for a handle that is not one, LayoutMismatchError for a pool that is not `layout` (but for num_blocks),
    FileNotFoundError where its fence is gone (its decode worker stopped)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        fields = json.loads(handle)
        if fields.get("format") != FORMAT:
            raise ValueError(f"format {fields.get('format')!r}, expected {FORMAT!r}")
        for name in _BYTES_FIELDS:
            fields[name] = None if fields[name] is None else bytes.fromhex(fields[name])
        dtype = getattr(torch, fields["dtype"])
        fence_name = str(fields["fence"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a CUDA IPC pool handle: {e}") from None
    pool = rebuild_cuda_tensor(
        torch.Tensor, tuple(fields["size"]), tuple(fields["stride"]), fields["offset"], torch.storage.TypedStorage,
        dtype, fields["device"], fields["storage_handle"], fields["storage_size_bytes"],
        fields["storage_offset_bytes"], False, fields["ref_counter_handle"], fields["ref_counter_offset"],
        fields["event_handle"], fields["event_sync_required"])
    layout.check_compatible(PageLayout.of_tensor(pool, layout.fingerprint))
    if not pool.is_contiguous():
        raise LayoutMismatchError("the exported pool is not contiguous")
    return OpenedPool(pool, FenceSegment.attach(fence_name, pool.shape[3]))


class CudaIpcTransport(CopyTransport):
    """Opened pools are kept per handle for the transport's life (opening maps device memory)."""
    kind = TransportKind.CUDA_IPC

    def __init__(self, layout: PageLayout) -> None:
        super().__init__(layout)
        self._pools: dict[bytes, OpenedPool] = {}

    def target_pool(self, dest: KVDestination) -> torch.Tensor:
        if not dest.cuda_ipc_handle:
            raise DestinationError("target.cuda_ipc_handle must be set for CUDA_IPC")
        if not torch.cuda.is_available():
            raise DestinationError("CUDA_IPC needs CUDA, and this worker has none")
        pool = self._pools.get(dest.cuda_ipc_handle)
        if pool is None:
            try:
                pool = self._pools[dest.cuda_ipc_handle] = open_handle(dest.cuda_ipc_handle, self.layout)
            except LayoutMismatchError:
                raise
            except (ValueError, RuntimeError) as e:  # not a handle, or CUDA cannot open it
                raise DestinationError(f"cannot open the CUDA IPC handle: {e}") from None
        return pool.tensor

    def fenced(self, dest: KVDestination, dst_blocks: Sequence[int]) -> AbstractContextManager:
        """Raises ReservationEndedError where the reservation ended before the copy (shm_transport.py's)."""
        return self._pools[dest.cuda_ipc_handle].fence_segment.fence.writing(dest.reservation_id, dst_blocks)

    async def write(self, request_id, src, src_blocks, dest, dst_blocks) -> int:
        dst = self.target_pool(dest)

        def copy() -> int:
            with torch.cuda.device(dst.device):
                num_bytes = copy_pages(src, list(src_blocks), dst, list(dst_blocks))
                # Done means in the decode worker's memory: it may read the pages as soon as we return.
                torch.cuda.current_stream().synchronize()
            return num_bytes

        # Held until the copy is in the decode worker's memory: a copy queued on the device is a late write too.
        with self.fenced(dest, dst_blocks):
            return await asyncio.to_thread(copy)

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.fence_segment.close()
        self._pools.clear()
