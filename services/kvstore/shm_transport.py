"""The SHARED_MEMORY transport: same host, CPU pools. Prefill maps the decode worker's
pool segment and copies its pages straight into the reserved blocks (one copy).

Attachments are kept per segment name: attaching maps the segment (a syscall and a header
check), which is not worth repeating per request. A segment whose name is gone (its decode
worker stopped, or was replaced by one with a new segment) is unmapped when the next is attached:
a mapping keeps the whole pool's memory alive, unlinked or not, for as long as it lasts.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch

from services.kvstore.shared_memory import SHM_DIR, SharedKVPool
from services.kvstore.transport import CopyTransport, DestinationError, KVDestination, TransportKind

log = logging.getLogger("baton.kvstore")


class SharedMemoryTransport(CopyTransport):
    kind = TransportKind.SHARED_MEMORY

    def __init__(self, layout) -> None:
        super().__init__(layout)  # our own; every target must match it but for num_blocks
        self._pools: dict[str, SharedKVPool] = {}

    def target_pool(self, dest: KVDestination) -> torch.Tensor:
        """Maps the segment on first use. Raises FileNotFoundError for no such segment,
        LayoutMismatchError for one whose header disagrees with our layout."""
        if not dest.shm_name:
            raise DestinationError("target.shm_name must be set for SHARED_MEMORY")
        pool = self._pools.get(dest.shm_name)
        if pool is None:
            self._detach_gone()
            pool = self._pools[dest.shm_name] = SharedKVPool.attach(dest.shm_name, self.layout)
        return pool.tensor

    def fenced(self, dest: KVDestination, dst_blocks: Sequence[int]) -> AbstractContextManager:
        """Raises ReservationEndedError where the reservation ended before the copy: its pages may be
        another request's (this process was stalled past its lease, or its request aborted)."""
        return self._pools[dest.shm_name].fence.writing(dest.reservation_id, dst_blocks)

    def _detach_gone(self) -> None:
        for name in [name for name in self._pools if not Path(SHM_DIR, name).exists()]:
            self._close(self._pools.pop(name))

    @staticmethod
    def _close(pool: SharedKVPool) -> None:
        try:
            pool.close()
        except BufferError as e:  # a copy's view outlived its write; the mapping goes with the view
            log.warning("%s", e)

    async def close(self) -> None:
        """Unmap every attachment (never unlinks: the decode workers own the segments)."""
        for pool in self._pools.values():
            self._close(pool)
        self._pools.clear()
