"""How the gateway calls its workers: on a call opened ahead of the request.

A new gRPC call costs both ends its set-up before the request is even read: the
client's call and headers, the server's call matching and a handler started for it.
On this VM that is about 0.4 ms of every request's time to first token
(bench/prefill_calls.py; bench/hop_floor.py finds about 0.5 ms with no service code
around it), and as much of its time to the second token, when the decode worker's
call is made. So the gateway keeps one call open to each worker it sends requests to
(Prefill.PrefillPreopened, Decode.DecodePreopened); a request takes it and sends its
request as the call's first message, and the next one is opened off the critical path
(`replenish`): a prefill worker's once the request is done with it (its pages handed
on, or its first token ending it), a decode worker's once its first tokens are out. A
request that finds none (several at once on one worker, or the first to it) makes a
new call (PrefillStream, Decode), as every request did before. Both answer alike, so
nothing after the call's start tells them apart.

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

from services.common import tracing
from services.gateway.workers import Worker

PREFILL_CALLS = Counter("baton_gateway_prefill_calls_total",
                        "Prompts sent to prefill workers, by the call that carried them: one opened ahead "
                        "(preopened) or a new one (new)", ["call"])
DECODE_CALLS = Counter("baton_gateway_decode_calls_total",
                       "Handed-off prompts sent to decode workers, by the call that carried them: one opened "
                       "ahead (preopened) or a new one (new)", ["call"])

MAX_IDLE_S = 30.0


class KeptCalls:
    """`start` a request's call on a worker: `new_method` of its stub, or with `preopen` the
    request as the first message of a kept `preopened_method` call where there is one.
    `counter`: counts each by the call that carried it."""

    def __init__(self, new_method: str, preopened_method: str, counter: Counter, timeout_s: float,
                 preopen: bool = True, max_idle_s: float = MAX_IDLE_S):
        self.new_method = new_method
        self.preopened_method = preopened_method
        self.timeout_s = timeout_s  # each request's deadline
        self.preopen = preopen
        self.max_idle_s = max_idle_s
        self._on_preopened, self._on_new = counter.labels("preopened"), counter.labels("new")
        self._kept: dict[Worker, tuple[grpc.aio.StreamStreamCall, float]] = {}  # the call, when it was opened
        self._is_closed = False

    async def start(self, worker: Worker, request):
        """The call answering `request` (read with `read()` or iterated, ended with `code()`)."""
        call = self._take(worker)
        if call is None:
            self._on_new.inc()
            return getattr(worker.stub, self.new_method)(request, timeout=self.timeout_s)
        try:
            await call.write(request)
        except BaseException:
            call.cancel()
            raise
        self._on_preopened.inc()  # once the request is on its way
        return call

    def replenish(self, worker: Worker) -> None:
        """Open `worker` a call for its next request, unless one is kept already."""
        if self.preopen and not self._is_closed and worker not in self._kept and not tracing.is_enabled():
            call = getattr(worker.stub, self.preopened_method)(timeout=self.timeout_s + self.max_idle_s)
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
