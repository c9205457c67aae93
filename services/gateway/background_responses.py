"""Responses API requests with `background: true`, as OpenAI serves them: the request is answered
at once with the response "queued"; it is generated after, its state kept in the response store
as it goes ("in_progress", then "completed" or "incomplete", "failed" with its error, or
"cancelled"), where `GET /v1/responses/{id}` reads it from any gateway sharing the store. While
it is generated, this gateway holds the store's lease on it (response_store.py): one whose gateway
died reads as "failed".
`POST /v1/responses/{id}/cancel` stops one: on this gateway at once; on another sharing Redis
through the store's cancel channel, which every gateway follows (`follow_cancels`).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError

from services.gateway.deltas import Delta
from services.gateway.errors import to_api_error
from services.gateway.response_store import GENERATOR_LEASE_S
from services.gateway.responses_api import ResponsesShape

log = logging.getLogger("baton.gateway.responses")
ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})
FOLLOW_RETRY_S = 1.0
CANCEL_AGAIN_S = 0.1


class BackgroundResponses:
    """The background responses this gateway is generating, by response id."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task] = {}
        self._following: asyncio.Task | None = None

    def follow_cancels(self, store) -> None:
        """Cancel the responses this gateway generates when any gateway asks `store` to."""
        async def follow() -> None:
            while True:
                try:
                    async for response_id in store.cancels():
                        await self.cancel(response_id)
                except (RedisError, OSError) as e:
                    log.warning("lost the response cancel channel (%s: %s); following again in %s s",
                                type(e).__name__, e, FOLLOW_RETRY_S)
                await asyncio.sleep(FOLLOW_RETRY_S)
        self._following = asyncio.ensure_future(follow())

    async def start(self, shape: ResponsesShape, choices: AsyncIterator[tuple[int, Delta]]) -> dict[str, Any]:
        """Store `shape`'s response "queued", generate it from `choices` in a task of its own,
        and return it as queued."""
        await _holding(shape)  # first: a reader that finds it queued finds its generator
        queued = shape.pending("queued")
        await shape.keep(queued)
        task = asyncio.ensure_future(self._generate(shape, choices))
        self._running[shape.id] = task
        task.add_done_callback(lambda _: self._running.pop(shape.id, None))
        return queued

    def is_running(self, response_id: str) -> bool:
        return response_id in self._running

    async def cancel(self, response_id: str) -> None:
        """Stop a response this gateway is generating; it is stored "cancelled" when this returns."""
        task = self._running.get(response_id)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every response still generating (the gateway is stopping)."""
        if self._following is not None:
            # Again until it ends: redis-py's read of the cancel channel can take a cancel that comes as its
            # own poll timeout runs out for that timeout, and then reads on (the gateway hung at shutdown).
            while not self._following.done():
                self._following.cancel()
                await asyncio.wait([self._following], timeout=CANCEL_AGAIN_S)
        for response_id in list(self._running):
            await self.cancel(response_id)

    async def _generate(self, shape: ResponsesShape, choices: AsyncIterator[tuple[int, Delta]]) -> None:
        renewing = asyncio.ensure_future(_renew(shape))
        try:
            try:
                await shape.keep(shape.pending("in_progress"))
                async for index, delta in choices:
                    shape.builder.add(index, delta)
                ended = shape.whole(shape.builder.whole())
            except asyncio.CancelledError:
                ended = shape.pending("cancelled")  # stored below, where the request's work has stopped
            except Exception as e:
                error = to_api_error(e, "input")
                log.warning("background response %s failed: %s", shape.id, error.message)
                ended = shape.pending("failed", error)
            finally:
                await choices.aclose()  # the workers stop generating for it
            await shape.keep(ended)
        finally:
            renewing.cancel()
        try:  # after its end is stored: a reader never sees it generating with no lease held
            await shape.store.let_go(shape.id)
        except (RedisError, OSError) as e:  # the lease lapses by itself
            log.warning("background response %s: lease not let go: %s: %s", shape.id, type(e).__name__, e)


async def _holding(shape: ResponsesShape) -> None:
    try:
        await shape.store.hold(shape.id)
    except (RedisError, OSError) as e:  # as `keep`: the response is generated even so
        log.warning("background response %s: lease not held: %s: %s", shape.id, type(e).__name__, e)


async def _renew(shape: ResponsesShape) -> None:
    while True:
        await asyncio.sleep(GENERATOR_LEASE_S / 3)
        await _holding(shape)
