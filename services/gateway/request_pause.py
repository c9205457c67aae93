"""A pause of the gateway's requests: those that arrive wait while it lasts, so an operator's
change to every worker (a weight update) happens between requests, never inside one."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class RequestPause:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.num_waiting = 0  # requests held at the pause now

    async def passed(self) -> None:
        """Return at once, or once the pause is over."""
        if self._open.is_set():
            return
        self.num_waiting += 1
        try:
            await self._open.wait()
        finally:
            self.num_waiting -= 1

    @asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """New requests wait for the duration of the block."""
        self._open.clear()
        try:
            yield
        finally:
            self._open.set()
