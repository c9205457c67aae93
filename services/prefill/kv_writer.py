"""Writing a prefilled request's pages into a decode worker's pool in shared memory.

`SharedMemoryTargets` owns this process's attachments to decode pools, one per
segment name, kept for the life of the service: attaching maps the segment (a
syscall and a header check), which is not worth repeating per request.
"""
from __future__ import annotations

import logging

import torch

from services.kvstore.layout import PageLayout
from services.kvstore.page_copy import copy_pages
from services.kvstore.shared_memory import SharedKVPool

log = logging.getLogger("baton.prefill")


class SharedMemoryTargets:
    """Attachments to decode workers' shared-memory pools, by segment name."""

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout  # this worker's own; every target must match it but for num_blocks
        self._pools: dict[str, SharedKVPool] = {}

    def attach(self, shm_name: str) -> SharedKVPool:
        """The attached pool named `shm_name` (mapped on first use). Raises FileNotFoundError for
        no such segment, LayoutMismatchError for one whose header disagrees with our layout."""
        pool = self._pools.get(shm_name)
        if pool is None:
            pool = self._pools[shm_name] = SharedKVPool.attach(shm_name, self.layout)
        return pool

    def close(self) -> None:
        """Unmap every attachment (never unlinks: the decode workers own the segments)."""
        for pool in self._pools.values():
            try:
                pool.close()
            except BufferError as e:  # a copy's view outlived the server; the mapping stays until exit
                log.warning("%s", e)
        self._pools.clear()


def write_pages(src: torch.Tensor, src_blocks: list[int], target: SharedKVPool, dst_blocks: list[int]) -> int:
    """Copy `src_blocks` of our pool into `dst_blocks` of the target pool; returns the bytes written.

    Safe off the engine thread while the source pages are held: held pages are never
    reallocated, and full (prefix-cached) ones are never written, until release.
    """
    return copy_pages(src, src_blocks, target.tensor, dst_blocks)
