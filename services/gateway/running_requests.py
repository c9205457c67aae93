"""The requests this gateway is generating, so that an operator can end them all at once (SGLang's
pause_generation in abort mode and abort_all, a weight update's abort_all_requests): each is aborted
on the decode worker its tokens stream from, whose stream then ends with finish_reason "abort" and
the text so far, whatever API asked for it. One whose prompt is still being prefilled has the call
computing its first token cancelled, which stops that worker's work on it (as a client going away
does), and ends with finish_reason "abort" and no text at once, not after its prefill (seconds, for a
long prompt). SGLang's `/abort_request` ends one by its id (the `x-request-id` of an OpenAI request,
an SGLang `rid`), or its samples `{id}-{n}`."""
from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc

from services.gateway.workers import Worker


class RunningRequest:
    """Where one request streams from, once it does, and the call computing its first token until then."""

    __slots__ = ("_abort_on", "worker", "request_id", "is_aborted", "_first_token_call")

    def __init__(self, abort_on: Callable[[Worker, str], None]) -> None:
        self._abort_on = abort_on
        self.worker: Worker | None = None
        self.request_id = ""
        self.is_aborted = False
        self._first_token_call: grpc.aio.Call | None = None

    def computes_first_token(self, call: grpc.aio.Call) -> None:
        """`call` computes its first token (a prefill worker's, or its decode worker's own prefill)."""
        self._first_token_call = call
        if self.is_aborted:
            call.cancel()

    def streams_from(self, worker: Worker, request_id: str) -> None:
        """Its stream has begun on `worker` as `request_id` (again, when it moved to another worker)."""
        self.worker, self.request_id = worker, request_id
        self._first_token_call = None
        if self.is_aborted:
            self._abort_on(worker, request_id)

    def abort(self) -> None:
        if not self.is_aborted:
            self.is_aborted = True
            if self.worker is not None:
                self._abort_on(self.worker, self.request_id)
            elif self._first_token_call is not None:
                self._first_token_call.cancel()

    def was_aborted_before_its_first_token(self) -> bool:
        """Whether the request's task, not cancelled itself, had its first token's call cancelled by
        `abort` (the call's reader then gets asyncio.CancelledError)."""
        task = asyncio.current_task()
        return self.is_aborted and self.worker is None and not (task is not None and task.cancelling())


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

    def abort_all(self) -> int:
        """Abort every running request; how many there were."""
        running = list(self._running)
        for request in running:
            request.abort()
        return len(running)

    def abort(self, request_id: str) -> int:
        """Abort the requests named `request_id`, or one of its samples `{request_id}-{n}`; how many."""
        sample = re.compile(re.escape(request_id) + r"(-\d+)?")
        named = [request for request, name in self._running.items() if sample.fullmatch(name)]
        for request in named:
            request.abort()
        return len(named)
