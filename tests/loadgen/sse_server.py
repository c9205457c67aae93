"""A real HTTP server on 127.0.0.1 that answers each POST with a scripted server-sent-event
stream (chunks sent after given delays), to test the client's timing and parsing exactly."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any


def sse(obj: Any) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


@dataclass
class Script:
    """The answer to one request: `status`, then each (delay_s, bytes) of `events` in turn."""

    events: list[tuple[float, bytes]] = field(default_factory=list)
    status: int = 200
    body: bytes = b""  # for a status other than 200


class ScriptedServer:
    """Serves `script` (or `script(request_body)`) to every POST; keeps the bodies it got and
    the most requests it held at once."""

    def __init__(self, script):
        self.script = script
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def __aenter__(self) -> "ScriptedServer":
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        host, port = self.server.sockets[0].getsockname()[:2]
        self.base_url = f"http://{host}:{port}/v1"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            body = json.loads(await reader.readexactly(length))
            self.bodies.append(body)
            script = self.script(body) if callable(self.script) else self.script
            if script.status != 200:
                writer.write(f"HTTP/1.1 {script.status} Error\r\ncontent-type: application/json\r\n"
                             f"content-length: {len(script.body)}\r\nconnection: close\r\n\r\n".encode() + script.body)
            else:
                # No length and no chunking: the body ends when the connection closes.
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
                for delay, data in script.events:
                    await writer.drain()
                    await asyncio.sleep(delay)
                    writer.write(data)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.in_flight -= 1
            writer.close()
