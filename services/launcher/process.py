"""One child process of `baton up`: started, read, probed and stopped.

A child runs in its own session (so a terminal's Ctrl-C reaches only `baton up`,
which then stops the children in order) and, on Linux, gets SIGTERM from the
kernel when `baton up` dies, even by SIGKILL, so no service outlives it.
Every line it writes is passed to `forward` as it comes; the last stderr lines
are kept for the report when it fails.
"""
from __future__ import annotations

import asyncio
import collections
import ctypes
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.addresses import WILDCARD_HOSTS

Stream = Literal["stdout", "stderr"]
# forward(child name, stream, line): where a child's output goes.
Forward = Callable[[str, Stream, str], None]

LINE_LIMIT = 1 << 20  # asyncio's default of 64 KiB would end the reader on one long log line
NUM_TAIL_LINES = 20
HEALTH_POLL_S = 0.1
DRAIN_TIMEOUT_S = 2.0  # a grandchild holding the pipes open must not stall the exit report
PR_SET_PDEATHSIG = 1
SETPRIV = shutil.which("setpriv")  # util-linux's


@dataclass(frozen=True)
class ChildSpec:
    """What to run and how to tell that it is up."""

    name: str  # "prefill-0": prefixes its output lines and names it in reports
    argv: tuple[str, ...]
    # Its first stdout line is this followed by HOST:PORT, once bound; None for a child
    # whose class knows its address and readiness itself (redis_server.RedisProcess).
    listening_prefix: str | None = None
    health_service: str = ""  # the grpc.health.v1 service name that turns SERVING once it is ready


class ChildFailed(Exception):
    """A child exited or did not become ready in time; `reason` completes "<name> ..."."""

    def __init__(self, child: ChildProcess, reason: str):
        super().__init__(f"{child.name} {reason}")
        self.child = child
        self.reason = reason


class ChildProcess:
    """One child: spawn, its listening address, health SERVING, and SIGTERM-then-SIGKILL stop."""

    def __init__(self, spec: ChildSpec, forward: Forward, *, cwd: str | None = None,
                 env: dict[str, str] | None = None):
        self.spec = spec
        self.forward = forward
        self.cwd = cwd
        self.env = env
        self.proc: asyncio.subprocess.Process | None = None
        self.address: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=NUM_TAIL_LINES)
        self.was_killed = False  # SIGKILLed by stop() after the SIGTERM timeout
        self._spawn: asyncio.Future | None = None
        self._exited: asyncio.Task[int] | None = None
        self._expected: list[tuple[Stream, re.Pattern[str], asyncio.Future[re.Match[str]]]] = []
        self._listening: asyncio.Future[re.Match[str]] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    @property
    def exited(self) -> asyncio.Task[int]:
        """Done with the exit code once the process ended and its output was read to the end."""
        assert self._exited is not None, "start() first"
        return self._exited

    def expect(self, pattern: str | re.Pattern[str], stream: Stream = "stdout") -> asyncio.Future[re.Match[str]]:
        """A future for the first line on `stream` that `pattern` matches (`re.search`); call before start()."""
        future = asyncio.get_running_loop().create_future()
        self._expected.append((stream, re.compile(pattern), future))
        return future

    async def start(self) -> None:
        if self.spec.listening_prefix is not None:
            self._listening = self.expect(f"^{re.escape(self.spec.listening_prefix)}(\\S+)$")
        # Shielded: a start-up cancelled mid-spawn must still learn the process it has to stop.
        argv, preexec_fn = dying_with_parent(self.spec.argv)
        self._spawn = asyncio.ensure_future(asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, cwd=self.cwd, env=self.env, limit=LINE_LIMIT,
            start_new_session=True, preexec_fn=preexec_fn))
        self._attach(await asyncio.shield(self._spawn))

    def _attach(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        readers = [asyncio.create_task(self._read(proc.stdout, "stdout")),
                   asyncio.create_task(self._read(proc.stderr, "stderr"))]
        self._exited = asyncio.create_task(self._wait(readers))

    async def wait_listening(self, deadline: float) -> str:
        """Its address once it is listening (its health may say NOT_SERVING yet: a worker binds before it
        loads), by loop time `deadline`. Raises ChildFailed if it exits first or the deadline passes."""
        assert self._listening is not None, "start() first"
        self.address = (await self.wait_for(self._listening, "listening", deadline)).group(1)
        return self.address

    async def wait_ready(self, deadline: float) -> str:
        """Its address once it is listening and health reports SERVING, by loop time `deadline`.
        Raises ChildFailed if it exits first or the deadline passes."""
        await self.wait_listening(deadline)
        await self.wait_for(self._poll_health(), "healthy (gRPC health SERVING)", deadline)
        return self.address

    async def wait_for(self, awaitable, what: str, deadline: float):
        """`awaitable`'s result, unless the process exits or `deadline` (loop time) passes first."""
        task = asyncio.ensure_future(awaitable)
        timeout = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait([task, self.exited], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        if task.done():
            return task.result()
        task.cancel()
        if self.exited.done():
            raise ChildFailed(self, f"{describe_exit(self.exited.result())} before it was {what}")
        raise ChildFailed(self, f"was not {what} in time")

    def send_signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:  # exited, not yet reaped
                pass

    def kill(self) -> None:
        """SIGKILL its whole process group (it leads one), so helpers it started go too."""
        if self.proc is not None and self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.send_signal(signal.SIGKILL)

    async def stop(self, timeout_s: float) -> int | None:
        """SIGTERM, then SIGKILL after `timeout_s`; its exit code (None if it never started)."""
        if self.proc is None and self._spawn is not None:  # start-up was cancelled mid-spawn
            try:
                self._attach(await self._spawn)
            except OSError:
                return None
        if self.proc is None:
            return None
        self.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                return await asyncio.shield(self.exited)
        except TimeoutError:
            self.was_killed = True
            self.kill()
            return await self.exited

    async def _poll_health(self) -> None:
        assert self.address is not None
        async with grpc.aio.insecure_channel(probe_address(self.address)) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            request = health_pb2.HealthCheckRequest(service=self.spec.health_service)
            while True:
                try:
                    response = await stub.Check(request, timeout=2.0)
                    if response.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:  # not accepting yet, or the name is not registered yet
                    pass
                await asyncio.sleep(HEALTH_POLL_S)

    async def _read(self, reader: asyncio.StreamReader, stream: Stream) -> None:
        while True:
            try:
                raw = await reader.readline()
            except ValueError:  # longer than LINE_LIMIT: asyncio dropped it
                self.forward(self.name, stream, f"<a line over {LINE_LIMIT} bytes was dropped>")
                continue
            if not raw:
                return
            line = raw.decode(errors="replace").rstrip("\r\n")
            if stream == "stderr":
                self.tail.append(line)
            for expected_stream, pattern, future in self._expected:
                if expected_stream == stream and not future.done() and (match := pattern.search(line)):
                    future.set_result(match)
            self.forward(self.name, stream, line)

    async def _wait(self, readers: Sequence[asyncio.Task]) -> int:
        assert self.proc is not None
        returncode = await self.proc.wait()
        await asyncio.wait(readers, timeout=DRAIN_TIMEOUT_S)
        for reader in readers:
            reader.cancel()
        for _, _, future in self._expected:
            future.cancel()
        return returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


def probe_address(address: str) -> str:
    """Where to reach a server from this host: a wildcard bind is reached on loopback."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host in WILDCARD_HOSTS else address


def dying_with_parent(argv: Sequence[str]) -> tuple[list[str], Callable[[], None] | None]:
    """`argv` and a preexec_fn (or None) that start it to get SIGTERM from the kernel when this
    process dies (Linux; elsewhere `argv` as it is). SIGTERM rather than SIGKILL so decode workers
    still unlink their shared-memory segments.

    util-linux's setpriv asks for the signal from the child, so no preexec_fn makes this process
    fork with gRPC loaded: gRPC's fork handlers then run in the child, and one such child died
    there before its exec (its log held only gRPC's epoll EBADF line). Without setpriv, the
    preexec_fn only calls prctl, getppid and kill, which take no lock another thread may hold.
    The signal is tied to the thread that forks: `baton up` forks from its event loop's thread,
    which lives as long as the process."""
    if not sys.platform.startswith("linux"):
        return list(argv), None
    if SETPRIV is not None:
        return [SETPRIV, "--pdeathsig", "TERM", *argv], None
    parent_pid = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True)  # resolved here: the forked child only calls it

    def set_parent_death_signal() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return list(argv), set_parent_death_signal
