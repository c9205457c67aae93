"""Reserve calls that wait for pages (ReserveRequest.wait_ms), first come first served.

A prompt whose decode worker has too few free pages now waits here, as a request waits in
vLLM's or SGLang's queue, rather than fail: running requests free pages as they finish.
The first waiter retries every RETRY_S (a call to the engine thread between its steps, which
is where pages are freed); the others wait behind it, in order, so a small reservation does
not pass a large one that came first. A call that does not wait, or comes when nobody waits,
tries at once. Once the worker is told to stop, those waiting stop waiting (WorkerStopping): its
pages would be of no use to them, and the gateway moves a request whose decode worker goes away
(UNAVAILABLE) to another.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from engine.admission import NoRoomYet

RETRY_S = 0.01


class WorkerStopping(Exception):
    """The worker is stopping: a Reserve waiting for its pages waits no more."""


class ReserveQueue:
    def __init__(self) -> None:
        self._head = asyncio.Lock()  # held by the first waiter; asyncio's Lock wakes its waiters in order
        self.num_waiting = 0
        self._stop = asyncio.Event()  # the worker's, once `end_when` gives it

    def end_when(self, stop: asyncio.Event) -> None:
        """Those waiting, and those that would, get WorkerStopping once `stop` is set."""
        self._stop = stop

    async def reserve(self, attempt: Callable[[], Awaitable[list[int]]], wait_s: float) -> list[int]:
        """`attempt()`'s pages, tried at once and then, while it raises NoRoomYet, again in turn for up
        to `wait_s`; the last NoRoomYet once that is over."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        if wait_s <= 0 or not self._head.locked():
            try:
                return await attempt()
            except NoRoomYet:
                if wait_s <= 0:
                    raise
        self.num_waiting += 1
        try:
            try:
                async with asyncio.timeout_at(deadline):
                    await self._head.acquire()
            except TimeoutError:
                raise NoRoomYet(f"no room for the reservation within {wait_s:g} s, behind "
                                f"{self.num_waiting - 1} waiting for pages") from None
            try:
                while not self._stop.is_set():  # the ones behind see it as they come to the head
                    try:
                        return await attempt()
                    except NoRoomYet:
                        left_s = deadline - loop.time()
                        if left_s <= 0:
                            raise
                    await asyncio.sleep(min(RETRY_S, left_s))
                raise WorkerStopping("the decode worker is stopping")
            finally:
                self._head.release()
        finally:
            self.num_waiting -= 1
