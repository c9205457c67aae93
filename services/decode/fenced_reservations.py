"""A decode worker's reservations as prefill processes may copy into their pages: granted, claimed by
Decode, or ended unclaimed (the lease ran out, or Abort), whose pages are freed once no copy into them
is under way.

Prefill processes on this host copy straight into the pool (a shared-memory segment, or a GPU pool by
CUDA IPC), and one stalled mid-copy (frozen, swapped out) may go on after the reservation ended: its
pages are then set aside under an id of their own (the request's may reserve again) and freed once the
copy lets go of their fence (services/kvstore/page_fence.py), tried every FENCE_RETRY_S; otherwise they
are freed at once. Counted as the error `pages_fenced`; the pages set aside now are the gauge
`baton_kv_pages_fenced` (pages a prefill process frozen mid-copy keeps from every request until it
goes on or dies).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from engine.llm_engine import LLMEngine
from services.common.engine_loop import EngineLoop
from services.common.metrics import ServiceMetrics
from services.decode.leases import Lease
from services.kvstore.page_fence import PageFence

FENCE_RETRY_S = 0.1
log = logging.getLogger("baton.decode")


class FencedReservations:
    """`fence`: the pool's (None once closed)."""

    def __init__(self, engine_loop: EngineLoop, fence: PageFence, metrics: ServiceMetrics) -> None:
        self.engine_loop = engine_loop
        self.fence: PageFence | None = fence
        self.metrics = metrics
        self._retries: set[asyncio.TimerHandle] = set()
        self._num_set_aside = 0
        metrics.gauge("baton_kv_pages_fenced", "KV pages of ended reservations kept from every request while a "
                      "prefill process copies into them").labels(**metrics.labels).set_function(
            lambda: self._num_set_aside)

    def granted(self, reservation_id: str, block_ids: list[int]) -> None:
        """Prefill processes may copy into `block_ids` for `reservation_id` from now."""
        if self.fence is not None:
            self.fence.grant(reservation_id, block_ids)

    def claimed(self, lease: Lease) -> None:
        """Decode took the pages: no prefill may copy into them any more."""
        if self.fence is not None:
            self.fence.revoke(lease.block_ids)

    def ending(self, lease: Lease) -> Callable[[LLMEngine], bool]:
        """What ends `lease`'s reservation on the engine thread (whether the engine held it): its pages
        freed, or set aside while a copy into them is under way."""
        def release(engine: LLMEngine) -> bool:
            return engine.release_reservation(lease.request_id)

        if self.fence is None:
            return release
        self.fence.revoke(lease.block_ids)
        if self.fence.is_unwritten(lease.block_ids):
            return release
        set_aside = f"{lease.request_id}#fenced-{lease.reservation_id}"
        log.warning("a prefill process is copying into the pages of %r, whose reservation ended: they are "
                    "freed once it stops", lease.request_id)
        self.metrics.count_error("pages_fenced")
        self._num_set_aside += len(lease.block_ids)
        self._retry(set_aside, lease.block_ids)
        return lambda engine: engine.rename_reservation(lease.request_id, set_aside)

    def _retry(self, set_aside: str, block_ids: frozenset[int]) -> None:
        handle = asyncio.get_running_loop().call_later(FENCE_RETRY_S, lambda: self._free_once_unwritten(
            handle, set_aside, block_ids))
        self._retries.add(handle)

    def _free_once_unwritten(self, handle: asyncio.TimerHandle, set_aside: str, block_ids: frozenset[int]) -> None:
        self._retries.discard(handle)
        if self.fence.is_unwritten(block_ids):
            self._num_set_aside -= len(block_ids)
            self.engine_loop.submit(lambda engine: engine.release_reservation(set_aside))
        else:
            self._retry(set_aside, block_ids)

    def close(self) -> None:
        """Before the pool is unmapped (its pages go with it): nothing here holds the engine, and so its
        views of the pool, any more."""
        for handle in self._retries:
            handle.cancel()
        self._retries.clear()
        self.fence = None
        self.engine_loop = None
