"""The one way a Baton service builds its gRPC server.

Every server gets, whatever it serves:
- `grpc.health.v1` health checking, per service name and for "" (the whole
  server), so `baton up`, compose and Kubernetes probe every service alike;
- server reflection, so `grpcurl` and debugging clients need no .proto files;
- message-size limits on sends and receives (limits.py), matching make_channel;
- with tracing on (tracing.py), a server span per call that continues the caller's trace.

`EarlyHeaders` lets a server-streaming handler send its response headers ahead of its
first message; `OpenedAhead` serves calls a client opens before it has their request.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common.keepalive import server_keepalive_options
from services.common.limits import DEFAULT_MAX_MESSAGE_BYTES, message_size_options
from services.common.tracing import server_interceptors

# A generated `add_<Service>Servicer_to_server` function and the servicer it adds.
AddServicer = Callable[[Any, grpc.aio.Server], None]

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
MAX_PENDING_CALLS = 1 << 20  # calls waiting for the server to take them: in effect, no limit


class HealthServicer(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 as grpc's own asyncio servicer serves it, except that a Watch stream ends once
    the server is shutting down, after it has said NOT_SERVING. A watcher (a gateway watches every
    worker) would otherwise hold the server's graceful stop for its whole grace period, however
    soon the calls doing work end: a worker given a long --shutdown-grace-s to finish its streams
    would then always take all of it."""

    def __init__(self) -> None:
        self._statuses = {"": SERVING}
        self._changed = asyncio.Condition()
        self._is_shutting_down = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        last_status = None
        async with self._changed:
            while True:
                status = self._statuses.get(request.service, SERVICE_UNKNOWN)
                if status != last_status:  # changes made between two wake-ups: the latest is what counts
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last_status = status
                if self._is_shutting_down:
                    return
                await self._changed.wait()

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        """Set `service`'s status (ignored once shutting down: it is NOT_SERVING for good)."""
        async with self._changed:
            if not self._is_shutting_down:
                self._statuses[service] = status
                self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good, said to every watcher, whose stream then ends."""
        async with self._changed:
            self._is_shutting_down = True
            self._statuses = dict.fromkeys(self._statuses, NOT_SERVING)
            self._changed.notify_all()


async def make_server(
    servicers: Sequence[tuple[AddServicer, Any]],
    service_names: Iterable[str],
    *,
    address: str = "127.0.0.1:0",
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    max_workers: int | None = None,
    health_servicer: HealthServicer | None = None,
    is_serving: bool = True,
) -> tuple[grpc.aio.Server, int]:
    """Build a grpc.aio server with `servicers` added and bound to `address`; return it and its port.

    `service_names` are the full names of the services added (e.g.
    `tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name`); health
    and reflection report exactly these. The server is not started: the caller
    runs `await server.start()` and, at exit, `await stop_server(...)`.

    Health is SERVING for each name and "" when `is_serving`, else NOT_SERVING;
    a service that must warm up first passes its own `health_servicer` and
    `is_serving=False`, then calls `set_serving(health_servicer, names, True)`.

    `max_workers` sizes a thread pool for servicer methods that are plain `def`
    (not `async def`); None leaves them to the event loop's default executor.

    Raises RuntimeError if the address cannot be bound (for example, taken).
    Must be awaited inside the event loop that will run the server.
    """
    service_names = list(service_names)
    options = [
        *message_size_options(max_message_bytes),
        *server_keepalive_options(),  # a client gone without a word has its calls cancelled
        # gRPC sets SO_REUSEPORT by default on Linux, so a second server on a
        # taken fixed port binds "successfully" and steals half the calls.
        ("grpc.so_reuseport", 0),
        # gRPC core cancels calls that arrive while 1000 wait for the server to take them (3000 at
        # once, past its hard limit): a burst of requests (1500 concurrent completions through one
        # prefill worker here) had some fail CANCELLED. They queue instead, as a vLLM or SGLang
        # server's do; what bounds the work is the gateway's --max-num-requests and the engines' queues.
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]
    pool = ThreadPoolExecutor(max_workers=max_workers) if max_workers else None
    server = grpc.aio.server(migration_thread_pool=pool, options=options, interceptors=server_interceptors() or None)
    for add_servicer, servicer in servicers:
        add_servicer(servicer, server)

    health_servicer = health_servicer or HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await set_serving(health_servicer, service_names, is_serving)
    reflection.enable_server_reflection(
        [*service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME], server
    )

    port = server.add_insecure_port(address)
    if port == 0:  # older grpcio reported a failed bind as port 0 rather than raising
        raise RuntimeError(f"could not bind gRPC server to {address}")
    return server, port


async def set_serving(
    health_servicer: HealthServicer, service_names: Iterable[str], is_serving: bool
) -> None:
    """Report every name in `service_names`, and "" (the whole server), as SERVING or NOT_SERVING."""
    status = SERVING if is_serving else NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


async def stop_server(
    server: grpc.aio.Server, health_servicer: HealthServicer | None = None, grace_s: float = 5.0
) -> None:
    """Stop gracefully: health turns NOT_SERVING first (so routers stop sending new
    work), then in-flight calls get `grace_s` seconds before being cancelled."""
    if health_servicer is not None:
        await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)


class EarlyHeaders:
    """A streaming call's response headers (initial metadata), sent while its first message is
    still being computed instead of together with it. gRPC sends them with the first message by
    default, and the receiver then handles both before it has that message. Timestamped in each
    process during bench/mesh_overhead.py, the first token took 0.44-0.46 ms instead of 0.60 from
    the prefill worker's yield to the gateway, and 0.44-0.45 ms instead of 0.55-0.75 from the
    gateway's yield to the client, with the headers gone ahead.

    `send_soon` starts sending them, from a task that runs at the handler's next await. Once it
    has been called, the handler awaits `sent` before writing a message or aborting the call:
    grpc.aio marks the headers sent only once they are, so either of those made meanwhile would
    carry a second copy and fail."""

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self._sending: asyncio.Future | None = None

    def send_soon(self) -> None:
        if self._sending is None:
            self._sending = asyncio.ensure_future(self._context.send_initial_metadata(()))
            # Failing means the call already ended (or its first message carried them): the
            # handler learns that from the call itself.
            self._sending.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def sent(self) -> None:
        if self._sending is not None and not self._sending.done():
            await asyncio.wait([self._sending])


class OpenedAhead:
    """Calls a client opens before it has their request (Prefill.PrefillPreopened,
    Decode.DecodePreopened): the request is the call's first message, whenever it comes.
    A caller keeps one open to every worker, so `end_idle_when(stop)` ends those still
    waiting for theirs UNAVAILABLE when `stop` is set: the server's graceful stop would
    otherwise wait its whole grace period for them.

    A waiting call's handler reads its message itself, and `stop` cancels it: waiting on both
    the read and `stop` (asyncio.wait, a task for the read) cost the request about 50 us more
    between its arrival and its handler, each step of that machinery run cold in a worker that
    had been idle (bench/mesh_overhead.py, timestamped)."""

    def __init__(self, what: str) -> None:
        self.what = what  # "the prefill worker": how the UNAVAILABLE message names this side
        self._stopping: asyncio.Future | None = None  # done once the worker stops serving
        self._is_stopped = False
        self._waiting: set[asyncio.Task] = set()  # the handlers of calls still waiting for their message

    def end_idle_when(self, stop: asyncio.Event) -> None:
        async def end_idle() -> None:
            await stop.wait()
            self._is_stopped = True
            for handler in self._waiting:
                handler.cancel()
        self._stopping = asyncio.ensure_future(end_idle())

    def close(self) -> None:
        if self._stopping is not None:
            self._stopping.cancel()

    async def first_request(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's first message (its response headers sent first: the call is opened ahead,
        so they go out off any request's path); None when the caller half-closed without one."""
        await context.send_initial_metadata(())
        handler = asyncio.current_task()
        if not self._is_stopped:
            self._waiting.add(handler)
            try:
                request = await context.read()
            except asyncio.CancelledError:
                if not self._is_stopped:  # the call itself was cancelled
                    raise
                handler.uncancel()
            else:
                return None if request is grpc.aio.EOF else request
            finally:
                self._waiting.discard(handler)
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.what} is shutting down")
