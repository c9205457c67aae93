"""A request's output queue: the engine thread puts the request's RequestOutputs into it, or the
error that came instead (a refusal, a failed engine), and asyncio code reads them off it. What the
queue of an EngineLoop's request holds is `EngineLoop.add_request`'s contract (engine_loop.py)."""
from __future__ import annotations

import asyncio
from typing import Any

from engine.outputs import RequestOutput


class RequestRefusedError(ValueError):
    """The engine refused a request it was given (its ValueError's message): the one item of that
    request's output queue. Not a failure of the engine: its outputs' other errors are."""


class IntoQueue:
    """What a command that starts a request reports to: as a concurrent Future to the engine
    thread, but only a failure is news (the request's outputs say the rest), and it goes into the
    request's output queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
        self._loop = loop
        self._outputs = outputs

    def set_running_or_notify_cancel(self) -> bool:
        return True

    def set_result(self, result: Any) -> None:
        pass

    def set_exception(self, error: BaseException) -> None:
        refused = isinstance(error, ValueError)
        hand_over(self._loop, self._outputs, RequestRefusedError(str(error)) if refused else error)


def hand_over(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue, item: Any) -> None:
    """Put `item` into a consumer's output queue, from the engine thread."""
    try:
        loop.call_soon_threadsafe(outputs.put_nowait, item)
    except RuntimeError:  # the consumer's loop is closed (shutdown)
        pass


async def finished(outputs: asyncio.Queue) -> RequestOutput:
    """A request's last output, read off its queue; raises the error that came instead."""
    while True:
        out = await outputs.get()
        if isinstance(out, BaseException):
            raise out
        if out.finished:
            return out
