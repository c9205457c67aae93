"""A client-streaming method's refusal, sent once the client has sent everything it meant to.

grpcio's asyncio client reports INTERNAL ("Failed execute_batch") instead of the server's status when
one of its writes fails because the server already ended the call (grpc/grpc#36066): a prefill worker
whose pages a decode worker or a kvstore node refuses midway would see that, not why. So a servicer
that refuses a stream reads the rest of it first; the client, having half-closed, gets the status."""
from __future__ import annotations

from collections.abc import AsyncIterator


class RefusingAfterStream:
    """`context` whose `abort` first reads `requests` to their end (everything else is the context's)."""

    def __init__(self, context, requests: AsyncIterator) -> None:
        self._context = context
        self._requests = requests

    async def abort(self, code, details: str) -> None:
        async for _ in self._requests:
            pass
        await self._context.abort(code, details)

    def __getattr__(self, name: str):
        return getattr(self._context, name)
