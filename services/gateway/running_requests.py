"""The requests this gateway is generating, so that an operator can end them all at once (SGLang's
pause_generation in abort mode and abort_all, a weight update's abort_all_requests): each is aborted
on the decode worker its tokens stream from, whose stream then ends with finish_reason "abort" and
the text so far, whatever API asked for it. One whose prompt is still being prefilled has the call
computing its first token cancelled, which stops that worker's work on it (as a client going away
does), and ends with finish_reason "abort" and no text at once, not after its prefill (seconds, for a
long prompt); so does one whose first token is out but whose KV is still being handed to its decode
worker (which has nothing of it yet to abort), with that token; one no worker has heard of yet (being
tokenized or routed) ends so before it reaches one.
SGLang's `/abort_request` ends one by its id (the `x-request-id` of an OpenAI request, an SGLang
`rid`), or its samples `{id}-{n}`, also while it waits at the gateway's pause; aborting them all
leaves those waiting, as SGLang's does (a pause in abort mode ends what runs, and holds what comes)."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from services.gateway.workers import Worker


class RunningRequest:
    """Where one request streams from, once it does, and what it waits on until then."""

    __slots__ = ("_abort_on", "worker", "request_id", "is_aborted", "is_held", "_awaited")

    def __init__(self, abort_on: Callable[[Worker, str], None]) -> None:
        self._abort_on = abort_on
        self.worker: Worker | None = None
        self.request_id = ""
        self.is_aborted = False
        self.is_held = False  # waiting at the gateway's pause
        self._awaited: grpc.aio.Call | asyncio.Future | None = None

    def waits_on(self, awaited: grpc.aio.Call | asyncio.Future) -> None:
        """It waits on `awaited` now, which `abort` cancels: the call computing its first token and then
        handing its KV over (a prefill worker's, or its decode worker's own prefill), or the end of the
        gateway's pause."""
        self._awaited = awaited
        if self.is_aborted:
            awaited.cancel()

    def streams_from(self, worker: Worker, request_id: str) -> None:
        """Its stream has begun on `worker` as `request_id` (again, when it moved to another worker). What
        it waited on stays: a prefill worker's call goes on handing the KV over after the first token."""
        self.worker, self.request_id = worker, request_id
        if self.is_aborted:
            self._abort_on(worker, request_id)

    def abort(self) -> None:
        if not self.is_aborted:
            self.is_aborted = True
            if self.worker is not None:
                self._abort_on(self.worker, self.request_id)
            # A prefill worker's call still handing the KV over is cancelled too: the decode worker, which
            # has nothing of the request yet, would not know the Abort (its reader then ends it "abort").
            if self._awaited is not None:
                self._awaited.cancel()

    def was_aborted_while_waiting(self) -> bool:
        """Whether the request's task, not cancelled itself, had what it waited on cancelled by `abort`
        (its reader then gets asyncio.CancelledError)."""
        task = asyncio.current_task()
        return self.is_aborted and not (task is not None and task.cancelling())


class RunningRequests:
    """`abort_on(worker, request_id)`: ends a request's stream on its decode worker, without waiting."""

    def __init__(self, abort_on: Callable[[Worker, str], None]) -> None:
        self._abort_on = abort_on
        self._running: dict[RunningRequest, str] = {}  # each to its id at the gateway

    @contextmanager
    def running(self, request_id: str) -> Iterator[RunningRequest]:
        request = RunningRequest(self._abort_on)
        self._running[request] = request_id
        try:
            yield request
        finally:
            del self._running[request]

    def abort_all(self) -> list[str]:
        """Abort every request past the pause; their ids."""
        running = [(request, name) for request, name in self._running.items() if not request.is_held]
        for request, _ in running:
            request.abort()
        return [name for _, name in running]

    def abort(self, request_id: str) -> list[str]:
        """Abort the requests named `request_id`, or one of its samples `{request_id}-{n}`; their ids."""
        sample = re.compile(re.escape(request_id) + r"(-\d+)?")
        named = [(request, name) for request, name in self._running.items() if sample.fullmatch(name)]
        for request, _ in named:
            request.abort()
        return [name for _, name in named]
