"""`Admission`: whether and when the gateway lets a request in, before any worker hears of it (a
RequestPipeline's base class, so that its checks cost the request's path no more than its own methods
would). A request that arrives while the gateway is paused (a weight update, a generation pause:
request_pause.py) waits until the pause is over, or until it is aborted there; then it is counted
among the requests in progress, or refused (OverloadedError) past `--max-num-requests`. The gateway's
metrics show both: the requests held at the pause, and those in progress."""
from __future__ import annotations

import asyncio

from services.common.metrics import ServiceMetrics
from services.gateway.request_errors import OverloadedError
from services.gateway.request_pause import RequestPause
from services.gateway.running_requests import RunningRequest


class Admission:
    """The requests in progress (`admit`, `release`), at most `max_num_requests` of them, and the
    gateway's pause (`pause`), which new requests wait out. `metrics`: the gateway's, where the two
    gauges go."""

    def __init__(self, metrics: ServiceMetrics, max_num_requests: int) -> None:
        self.max_num_requests = max_num_requests  # 0: no limit
        self.num_requests = 0  # being generated now (each choice of a request counts)
        metrics.gauge("baton_gateway_requests_in_progress",
                      "Requests the gateway holds now, each choice of n counting (what --max-num-requests "
                      "limits)").labels(**metrics.labels).set_function(lambda: self.num_requests)
        self.pause = RequestPause()  # held by weight updates (weight_updates.py) and generation pauses
        metrics.gauge("baton_gateway_requests_held", "Requests waiting at the gateway for a pause to end (a "
                      "generation pause, a weight update)").labels(**metrics.labels).set_function(
            lambda: self.pause.num_waiting)

    async def _pause_passed(self, running: RunningRequest) -> None:
        """Return once the gateway's pause (if any) is over, or `running` was aborted while it waited
        (the request then ends with finish_reason "abort" before it reaches a worker)."""
        if self.pause.is_open:  # no task on every request's path
            return
        waiting = asyncio.ensure_future(self.pause.passed())
        running.waits_on(waiting)
        running.is_held = True
        try:
            await waiting
        except asyncio.CancelledError:
            if not running.was_aborted_while_waiting():
                raise
        finally:
            running.is_held = False

    def admit(self, num: int = 1) -> None:
        """Count `num` more requests in progress (`release` them once they are done), or raise
        OverloadedError: admission control, before any worker hears of them. Past the limit a request
        would only queue behind the others on the workers, its time to first token growing with the queue."""
        if self.max_num_requests and self.num_requests + num > self.max_num_requests:
            raise OverloadedError(f"{self.num_requests} requests in progress, the gateway's limit "
                                  f"(--max-num-requests)")
        self.num_requests += num

    def release(self, num: int = 1) -> None:
        """`num` requests `admit` counted are done."""
        self.num_requests -= num
