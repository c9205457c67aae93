"""`FirstEventResponse`: a streamed response whose status line waits for its first event.

Starlette's StreamingResponse sends `200` and its headers before it asks its body for
anything. This one is given the task that makes its first event, started by the endpoint,
and sends nothing before it is done: a first event that fails with `APIError` (a request
refused or failed before its first token) makes the response that error, with its real
status, not a 200 with an error event. So the endpoint can return it as soon as the
request is on its way, and the framework sets up the stream (the response's task and the
one watching for the client's disconnect) while the prompt computes, not once the first
token is there: timestamped in the gateway, that set-up had taken about 0.35 ms between
the first token's delta and its event on the way out. A client that goes away before the
first event cancels that task, as it cancels the body after it.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.gateway.errors import APIError, api_error_response


class FirstEventResponse(StreamingResponse):
    """`first`: the task making the body's first event (or raising APIError); `content`: the body after it."""

    def __init__(self, first: asyncio.Future, content: AsyncIterator[bytes], **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.first = first
        first.add_done_callback(lambda f: f.cancelled() or f.exception())  # read here, whoever else does

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.first.cancel()  # still running: nobody will read it, and its request ends on the mesh

    async def stream_response(self, send: Send) -> None:
        try:
            first = await self.first
        except APIError as e:
            error = api_error_response(e)
            await send({"type": "http.response.start", "status": error.status_code, "headers": error.raw_headers})
            await send({"type": "http.response.body", "body": error.body})
            return
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": first, "more_body": True})
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
