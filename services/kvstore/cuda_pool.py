"""A decode worker's KV pool on a CUDA device: carved once at start-up, as SharedKVPool is on the
CPU, and offered to prefill workers on this host by its CUDA IPC handle (cuda_ipc.py), through
which they write reserved pages device to device, fenced by its pages' tokens in a small
shared-memory segment (fence_segment.py). Other hosts reach it by the gRPC stream."""
from __future__ import annotations

import torch

from engine.dtypes import PAGE_DTYPES
from services.kvstore.cuda_ipc import export_handle
from services.kvstore.fence_segment import FenceSegment
from services.kvstore.layout import PageLayout


class CudaKVPool:
    name = ""  # its pages are in no shared-memory segment: the handle reaches them on this host

    def __init__(self, layout: PageLayout, device: str) -> None:
        self.layout = layout
        self.tensor: torch.Tensor | None = torch.zeros(layout.shape, dtype=PAGE_DTYPES[layout.dtype], device=device)
        self.fence_segment = FenceSegment.create(layout.num_blocks)
        self.fence = self.fence_segment.fence
        try:
            self.ipc_handle = export_handle(self.tensor, self.fence_segment.name)
        except BaseException:
            self.fence_segment.close()
            raise

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    def close(self) -> None:
        """Its memory goes back to the device once the engine's views are gone too; its fence's segment
        is unlinked."""
        self.tensor = None
        self.fence = None
        self.fence_segment.close()
