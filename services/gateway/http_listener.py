"""`HttpListener`: the HTTP API's uvicorn server inside the gateway's own event loop, so that the
process's signal handlers stay the gateway's: bound before it is announced, stopped with a grace
for the requests in flight."""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
import socket

import uvicorn
from fastapi import FastAPI

from services.common.entrypoint import StartError
from services.gateway.http_serving import HttpServing

HTTP_BACKLOG = 2048  # uvicorn's own default
TICK_S = 0.1  # uvicorn's


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside our event loop: the process's signal handlers stay ours, and a stop is seen at once."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.exit_requested = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    async def main_loop(self) -> None:
        # uvicorn's own sleeps a tick (0.1 s) between its looks at should_exit: every gateway's stop waited
        # up to that long. Its ticks go on as they were (the date header's once a second).
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self.exit_requested.wait()


class HttpListener:
    def __init__(self) -> None:
        self._server: _EmbeddedServer | None = None
        self._serving: asyncio.Task | None = None

    def start(self, app: FastAPI, host: str, port: int, serving: HttpServing, grace_s: float) -> int:
        """Serve `app` on host:port (0: any free port) from now; the port. StartError when it cannot bind."""
        try:
            sock = _bind(host, port)
        except OSError as e:
            raise StartError(f"cannot bind HTTP to {host}:{port}: {e}") from e
        self._server = _EmbeddedServer(uvicorn.Config(app, lifespan="off",
                                                      timeout_graceful_shutdown=max(1, math.ceil(grace_s)),
                                                      **serving.uvicorn_options()))
        # In a context of its own, not the caller's (where the `boot` span is current): OpenTelemetry's
        # ASGI middleware continues the current span, if any, instead of the caller's traceparent.
        self._serving = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]),
                                                               context=contextvars.Context())
        return sock.getsockname()[1]

    async def stop(self) -> None:
        """Stop taking requests; those in flight get the grace."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.exit_requested.set()
            await asyncio.gather(self._serving, return_exceptions=True)


def _bind(host: str, port: int) -> socket.socket:
    """Bound and listening: the address is printed before uvicorn's task first runs, and a client
    that connects in between must wait in the backlog, not be refused (uvicorn listens again, as
    it does on any socket it is given)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(HTTP_BACKLOG)
    sock.set_inheritable(True)
    return sock
