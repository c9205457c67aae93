"""A request's choices as the HTTP API answers them: one JSON body once they are all done, or a
stream of server-sent events ending in `data: [DONE]`, returned once a prompt is on its way
(FirstEventResponse). A client that goes away cancels its choices wherever they are: Starlette
cancels a stream's body, and a whole response waits `unless_disconnected`."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse

from services.gateway.choices import first_choice
from services.gateway.deltas import Delta
from services.gateway.errors import to_api_error
from services.gateway.first_event_response import FirstEventResponse
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.timeline import ResponseTimeline

T = TypeVar("T")


class ResponseShape(Protocol):
    """An API's own shape of a generation's output (the Responses API's, the Messages API's, the tokens
    API's), made from what chat's or completions' builder makes of it."""

    async def keep(self, response: dict[str, Any]) -> None: ...

    def whole(self, built: dict[str, Any]) -> dict[str, Any]: ...

    def events(self, choices: AsyncIterator[tuple[int, Delta]], prompt_param: str) -> AsyncIterator[bytes]: ...


class ClientDisconnected(Exception):
    """The HTTP client went away before its response was ready."""


async def respond(request: Request, choices: AsyncIterator[tuple[int, Delta]], builder: ResponseBuilder,
                  stream: bool, include_usage: bool, prompt_param: str, dispatched: asyncio.Future,
                  timeline: ResponseTimeline | None = None, shape: ResponseShape | None = None,
                  continuous_usage: bool = False):
    """`timeline`: the request's ledger, when it is to be sent with the response. `dispatched` is
    done once a choice's prompt is on its way to a worker: a stream is returned then, its first
    event still to come (FirstEventResponse). `shape`: an API's own (the Responses API's, ...), not
    chat's or completions'. `continuous_usage`: every chunk carries its choice's usage so far."""
    if stream:
        events = (shape.events(choices, prompt_param) if shape is not None
                  else _events(choices, builder, include_usage, prompt_param, timeline, continuous_usage))
        first = asyncio.ensure_future(anext(events))
        try:
            await asyncio.wait([first, dispatched], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            first.cancel()
            raise
        return FirstEventResponse(first, events, media_type="text/event-stream",
                                  headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                           "x-request-id": builder.id})

    async def collect() -> None:
        async for index, delta in choices:
            builder.add(index, delta)
    try:
        await unless_disconnected(request, collect())
    except ClientDisconnected:
        await choices.aclose()
        return JSONResponse({}, status_code=499)  # nobody reads it; what access logs expect
    except Exception as e:
        await choices.aclose()
        raise to_api_error(e, prompt_param) from e
    body = builder.whole() if shape is None else shape.whole(builder.whole())
    if shape is not None:
        await shape.keep(body)
    if timeline is not None:
        body["timeline"] = timeline.to_json()
    return JSONResponse(body, headers={"x-request-id": builder.id})


async def _events(choices: AsyncIterator[tuple[int, Delta]], builder: ResponseBuilder, include_usage: bool,
                  prompt_param: str, timeline: ResponseTimeline | None,
                  continuous_usage: bool = False) -> AsyncIterator[bytes]:
    """The SSE body: APIError before the first event (the response's status then), an error event
    after it. Starlette cancels this when the client disconnects; the cancellation reaches every
    choice's pipeline, which aborts its request on the mesh."""
    try:
        first = await first_choice(choices, prompt_param)
        yield sse_event(builder.chunk(*first, include_usage, continuous_usage))
        try:
            async for index, delta in choices:
                yield sse_event(builder.chunk(index, delta, include_usage, continuous_usage))
            if include_usage:
                yield sse_event(builder.usage_chunk())
            if timeline is not None:
                yield sse_event(builder.timeline_chunk(timeline.to_json()))
        except Exception as e:  # after the 200 went out: the error travels as an event, as vLLM sends it
            yield sse_event(to_api_error(e, prompt_param).body())
    finally:
        await choices.aclose()
    yield b"data: [DONE]\n\n"


def sse_event(body: dict[str, Any]) -> bytes:
    """One server-sent event. orjson: an SGLang event carries every token id so far, which took the
    standard library 67 us to write at 750 tokens (a fifth of the gateway's time per event), orjson 4."""
    return b"data: " + orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`await work`, cancelled as soon as the client disconnects (ClientDisconnected).

    The body has been read by now, so the next ASGI message can only be the
    disconnect; waiting for it costs nothing while the client stays."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
