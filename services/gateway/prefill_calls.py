"""How the gateway calls the prefill workers: on a call opened ahead of the request.

A new gRPC call costs both ends its set-up before the request is even read: the
client's call and headers, the server's call matching and a handler started for it.
On this VM that is about 0.4 ms of every request's time to first token
(bench/prefill_calls.py; bench/hop_floor.py finds about 0.5 ms with no service code
around it). So the gateway keeps one Prefill.PrefillPreopened call open to each
prefill worker it sends prompts to; a request takes it and sends its PrefillRequest as
the call's first message, and the next one is opened once that request is done with
the worker (its pages handed on, or its first token ending it), off the critical path
of both (`replenish`). A request that finds none (several at once on one worker, or the
first to it) makes a new PrefillStream call, as every request did before. Both answer
alike, so nothing after the call's start tells them apart.

A kept call is dropped for a new one when:
- it has ended: the worker shut down (it ends waiting calls UNAVAILABLE) or a proxy
  between them closed it;
- it is older than `max_idle_s`: its deadline was set when it was opened, to the
  request deadline plus `max_idle_s`, so each request's deadline stays within that much
  of the configured one.

None is kept while tracing: a call's trace context is fixed when it is opened, so a
kept call's spans would join no request's trace.
"""
from __future__ import annotations

import time

import grpc
from prometheus_client import Counter

from protos import prefill_pb2
from services.common import tracing
from services.gateway.workers import Worker

PREFILL_CALLS = Counter("baton_gateway_prefill_calls_total",
                        "Prompts sent to prefill workers, by the call that carried them: one opened ahead "
                        "(preopened) or a new one (new)", ["call"])
ON_PREOPENED, ON_NEW = PREFILL_CALLS.labels("preopened"), PREFILL_CALLS.labels("new")

MAX_IDLE_S = 30.0


class PrefillCalls:
    """`start` a request's PrefillStream on a worker; with `preopen`, on a kept call where it can."""

    def __init__(self, timeout_s: float, preopen: bool = True, max_idle_s: float = MAX_IDLE_S):
        self.timeout_s = timeout_s  # each request's deadline
        self.preopen = preopen
        self.max_idle_s = max_idle_s
        self._kept: dict[Worker, tuple[grpc.aio.StreamStreamCall, float]] = {}  # the call, when it was opened
        self._is_closed = False

    async def start(self, worker: Worker, request: prefill_pb2.PrefillRequest):
        """The call answering `request` with PrefillEvents (read with `read()`, ended with `code()`)."""
        call = self._take(worker)
        if call is None:
            ON_NEW.inc()
            return worker.stub.PrefillStream(request, timeout=self.timeout_s)
        ON_PREOPENED.inc()
        try:
            await call.write(request)
        except BaseException:
            call.cancel()
            raise
        return call

    def replenish(self, worker: Worker) -> None:
        """Open `worker` a call for its next request, unless one is kept already."""
        if self.preopen and not self._is_closed and worker not in self._kept and not tracing.is_enabled():
            call = worker.stub.PrefillPreopened(timeout=self.timeout_s + self.max_idle_s)
            self._kept[worker] = (call, time.monotonic())

    def close(self) -> None:
        """End every kept call; none is opened after."""
        self._is_closed = True
        for call, _ in self._kept.values():
            call.cancel()
        self._kept.clear()

    def _take(self, worker: Worker) -> grpc.aio.StreamStreamCall | None:
        kept = self._kept.pop(worker, None)
        if kept is None:
            return None
        call, opened_at = kept
        if call.done() or time.monotonic() - opened_at > self.max_idle_s:
            call.cancel()
            return None
        return call
