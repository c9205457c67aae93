"""The requests this gateway is generating, so that an operator can end them all at once (SGLang's
pause_generation in abort mode and abort_all, a weight update's abort_all_requests): each is aborted
on the decode worker its tokens stream from, whose stream then ends with finish_reason "abort" and
the text so far, whatever API asked for it. One whose stream has not begun (its prompt still being
prefilled) is aborted as its first token arrives. SGLang's `/abort_request` ends one by its id (the
`x-request-id` of an OpenAI request, an SGLang `rid`), or its samples `{id}-{n}`."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from services.gateway.workers import Worker


class RunningRequest:
    """Where one request streams from, once it does."""

    __slots__ = ("_abort_on", "worker", "request_id", "is_aborted")

    def __init__(self, abort_on: Callable[[Worker, str], None]) -> None:
        self._abort_on = abort_on
        self.worker: Worker | None = None
        self.request_id = ""
        self.is_aborted = False

    def streams_from(self, worker: Worker, request_id: str) -> None:
        """Its stream has begun on `worker` as `request_id` (again, when it moved to another worker)."""
        self.worker, self.request_id = worker, request_id
        if self.is_aborted:
            self._abort_on(worker, request_id)

    def abort(self) -> None:
        if not self.is_aborted:
            self.is_aborted = True
            if self.worker is not None:
                self._abort_on(self.worker, self.request_id)


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
