"""A loopback port held for a child to bind, so that its address is known before it has started.

The launcher binds the port itself with SO_REUSEADDR and never listens on it. On Linux the child's
gRPC server, which sets SO_REUSEADDR on its listening sockets as gRPC always does, binds the same port
beside it and is the only one listening, so every connection reaches the child; meanwhile a bind
without that option is refused the port, and the kernel passes over it when it picks the local port of
an outgoing connection. A port only picked free and let go could be taken in the second the child
takes to start. Elsewhere (BSD sockets want SO_REUSEPORT on both for that) the port is let go at once:
picked free, as Redis's is.
"""
from __future__ import annotations

import socket
import sys


class HeldPort:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._sock: socket.socket | None = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        self.port: int = self._sock.getsockname()[1]
        if sys.platform != "linux":
            self.release()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def release(self) -> None:
        """Let the port go: once the child listens on it, or its start failed."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
