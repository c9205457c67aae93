"""A pause of the gateway's requests: those that arrive wait while it lasts, so an operator's
change to every worker (a weight update) happens between requests, never inside one."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


class RequestPause:
    """Held by each of its holders (a weight update, an operator's /pause_generation) until each lets go."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._num_holds = 0
        self.num_waiting = 0  # requests held at the pause now
        self.on_wait: Callable[[], None] | None = None  # told when a request begins to wait (idle_sleep.py)

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    async def passed(self) -> None:
        """Return at once, or once the pause is over."""
        if self._open.is_set():
            return
        self.num_waiting += 1
        if self.on_wait is not None:
            self.on_wait()
        try:
            await self._open.wait()
        finally:
            self.num_waiting -= 1

    def hold(self) -> None:
        """New requests wait from now until `let_go` has been called once for this and every other `hold`."""
        self._num_holds += 1
        self._open.clear()

    def let_go(self) -> None:
        self._num_holds -= 1
        if not self._num_holds:
            self._open.set()

    @asynccontextmanager
    async def holding(self) -> AsyncIterator[None]:
        """New requests wait for the duration of the block."""
        self.hold()
        try:
            yield
        finally:
            self.let_go()
