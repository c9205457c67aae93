"""How the gateway calls its workers: on a call opened ahead of the request.

A new gRPC call costs both ends its set-up before the request is even read: the
client's call and headers, the server's call matching and a handler started for it.
On this VM that is about 0.4 ms of every request's time to first token
(bench/prefill_calls.py; bench/hop_floor.py finds about 0.5 ms with no service code
around it), and as much of its time to the second token, when the decode worker's
call is made. So the gateway keeps calls open to each worker it sends requests to
(Prefill.PrefillPreopened, Decode.DecodePreopened); a request takes one and sends its
request as the call's first message, and a call for a next one is opened off the critical
path (`replenish`): a prefill worker's once the request is done with it (its pages handed
on, or its first token ending it), a decode worker's once its first tokens are out, or once
either is cut short by anything but the worker. Each request sent to a worker opens one, up
to `per_worker` kept: as many as came at once, so the next such burst finds a call for each
of its requests. A request that finds none (more at once than came before, or the first to a
worker) makes a new call (PrefillStream, Decode), as every request did before. Both answer alike, so nothing after
the call's start tells them apart.

A kept call is dropped for a new one when:
- it has ended, before its request or while it was being written: the worker shut down
  (it ends waiting calls UNAVAILABLE) or a proxy between them closed it;
- it is older than `max_idle_s`: its deadline was set when it was opened, to the
  request deadline plus `max_idle_s`, so each request's deadline stays within that much
  of the configured one.

None is kept while tracing: a call's trace context is fixed when it is opened, so a
kept call's spans would join no request's trace.
"""
from __future__ import annotations

import time
from collections import deque

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
PER_WORKER = 8  # kept calls: an idle one costs a worker a waiting handler, and its connection a stream


class KeptCalls:
    """`start` a request's call on a worker: `new_method` of its stub, or with `preopen` the
    request as the first message of a kept `preopened_method` call where there is one.
    `counter`: counts each by the call that carried it."""

    def __init__(self, new_method: str, preopened_method: str, counter: Counter, timeout_s: float,
                 preopen: bool = True, max_idle_s: float = MAX_IDLE_S, per_worker: int = PER_WORKER):
        self.new_method = new_method
        self.preopened_method = preopened_method
        self.timeout_s = timeout_s  # each request's deadline
        self.preopen = preopen
        self.max_idle_s = max_idle_s
        self.per_worker = per_worker
        self._on_preopened, self._on_new = counter.labels("preopened"), counter.labels("new")
        # Per worker, newest last: each call, and when it was opened.
        self._kept: dict[Worker, deque[tuple[grpc.aio.StreamStreamCall, float]]] = {}
        self._is_closed = False

    async def start(self, worker: Worker, request):
        """The call answering `request` (read with `read()` or iterated, ended with `code()`)."""
        call = self._take(worker)
        if call is not None:
            try:
                await call.write(request)
            except grpc.aio.AioRpcError:
                # The worker ended the call while the request was being written, so never read it: a
                # call's end can reach its writer before its status does, and grpc then says INTERNAL
                # (grpc/grpc#36066) rather than the worker's UNAVAILABLE, which would fail the request
                # where a worker going away moves it. A new call gets the worker's own answer.
                call.cancel()
            except BaseException:
                call.cancel()
                raise
            else:
                self._on_preopened.inc()  # once the request is on its way
                return call
        self._on_new.inc()
        return getattr(worker.stub, self.new_method)(request, timeout=self.timeout_s)

    def replenish(self, worker: Worker, ended_on: BaseException | None = None) -> None:
        """Open `worker` a call for a next request, unless `per_worker` are kept already. `ended_on`:
        what cut the request short, if anything. An error from the worker itself opens none (a worker
        in trouble gets no call kept open to it); a consumer gone away or a stop string does: without
        that, a busy gateway whose clients often leave early sent half its prompts on new calls (a
        soak of 24 clients: 558 new against 498 kept)."""
        if not self.preopen or self._is_closed or tracing.is_enabled() or isinstance(ended_on, grpc.aio.AioRpcError):
            return
        kept = self._kept.setdefault(worker, deque())
        if len(kept) < self.per_worker:
            kept.append((getattr(worker.stub, self.preopened_method)(timeout=self.timeout_s + self.max_idle_s),
                         time.monotonic()))

    def forget(self, worker: Worker) -> None:
        """End the calls kept to `worker`, which left its pool."""
        for call, _ in self._kept.pop(worker, ()):
            call.cancel()

    def close(self) -> None:
        """End every kept call; none is opened after."""
        self._is_closed = True
        for kept in self._kept.values():
            for call, _ in kept:
                call.cancel()
        self._kept.clear()

    def _take(self, worker: Worker) -> grpc.aio.StreamStreamCall | None:
        """The newest of `worker`'s kept calls, if still open and young enough (else the next, and so
        on). Newest first: after a burst, sparser requests reuse the few most recent calls while the
        rest wait for the next burst, rather than each finding the oldest expired."""
        kept = self._kept.get(worker)
        while kept:
            call, opened_at = kept.pop()
            if not call.done() and time.monotonic() - opened_at <= self.max_idle_s:
                return call
            call.cancel()
        return None
