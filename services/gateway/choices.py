"""Several pipeline streams as one: the choices of a request (n × prompts), tagged by index.

Every stream runs concurrently (each is its own request on the mesh), and every one
is closed when the merged stream ends early — a client gone, an error in one choice —
so none leaves pages held.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from services.gateway.deltas import Delta
from services.gateway.errors import APIError, to_api_error

_DONE = object()


def choice_request_id(response_id: str, choice: int, num_choices: int) -> str:
    """The mesh request id of one choice: the response id itself when it is the only one."""
    return response_id if num_choices == 1 else f"{response_id}-{choice}"


async def merge_choices(streams: Sequence[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every stream, in arrival order. The first error in any
    stream is raised here after the others are cancelled."""
    if len(streams) == 1:  # the common case, without a task per stream
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async with aclosing(stream) as deltas:
                async for delta in deltas:
                    await queue.put((index, delta))
            await queue.put((index, _DONE))
        except Exception as e:  # handed to the consumer, which raises it
            await queue.put((index, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_choice(choices: AsyncIterator[tuple[int, Delta]], prompt_param: str) -> tuple[int, Delta]:
    """The first (choice index, delta) of a stream about to start; the APIError that ended the
    request before it, its response's status then."""
    try:
        return await anext(choices)
    except StopAsyncIteration:
        raise APIError(500, "the request ended without output", code="internal_error") from None
    except Exception as e:
        raise to_api_error(e, prompt_param) from e
