"""Ending a prefill-only request in the engine once no page write reads its held pages.

Ended sooner (a call cancelled while its write runs), the pages could be reallocated and
overwritten under the write, and the decode worker would get another request's KV.
"""
from __future__ import annotations

import asyncio

from services.common.engine_loop import EngineLoop


def release_after(engine_loop: EngineLoop, request_id: str, pending_copy: asyncio.Future | None) -> None:
    """Abort or release `request_id` in the engine, once no write reads its pages any more."""
    def release(_=None) -> None:
        if pending_copy is not None and not pending_copy.cancelled():
            pending_copy.exception()  # retrieved: the call (if still there) reported it
        engine_loop.cancel_soon(request_id)

    if pending_copy is None or pending_copy.done():
        release()
    else:
        pending_copy.add_done_callback(release)
