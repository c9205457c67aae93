"""A worker's health as routing sees it: its grpc.health.v1 Watch stream keeps `is_serving` current.

A worker whose stream breaks (it died) is out of routing until it serves again, asked again every
WATCH_RETRY_S; one whose stream had been up a while is asked again at once, and left in routing unless
that call fails or does not answer within WATCH_RETRY_S. One whose health
turns SERVING is first given what the others were given while it was away (its pool's
`before_serving` calls), and stays out of routing where that fails.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

if TYPE_CHECKING:  # workers imports this module to watch its workers
    from services.gateway.workers import Worker

log = logging.getLogger("baton.gateway")

WATCH_RETRY_S = 0.5  # how soon a worker whose health stream broke is watched again


async def watch_worker(worker: Worker, service_name: str, kind: str,
                       before_serving: Sequence[Callable[[Worker], Awaitable[None]]]) -> None:
    """Keep `worker.is_serving` current from its Watch stream of `service_name`, until cancelled."""
    stub = health_pb2_grpc.HealthStub(worker.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    leaving: asyncio.TimerHandle | None = None  # a broken stream's worker, routed to while it is asked again
    try:
        while True:
            call = stub.Watch(health_pb2.HealthCheckRequest(service=service_name))
            watched_at = time.monotonic()
            was_up = False  # it answered (and went on answering, unless its preparation failed)
            try:
                async for response in call:
                    if leaving is not None:
                        leaving.cancel()
                        leaving = None
                    is_serving = response.status == serving
                    if is_serving and not worker.is_serving and not await _prepared(worker, kind, before_serving):
                        call.cancel()  # watched again after a pause: its first answer then tries once more
                        was_up = False
                        break
                    was_up = True
                    if is_serving != worker.is_serving:
                        log.info("%s %s is %s", kind, worker.address, "serving" if is_serving else "not serving")
                    worker.is_serving = is_serving
            except grpc.aio.AioRpcError:
                pass
            if leaving is not None:  # asked again at once, it did not answer
                leaving.cancel()
                leaving = None
            elif was_up and time.monotonic() - watched_at >= WATCH_RETRY_S:
                # A stream that was up a while is watched again at once, the worker left in routing for up to
                # WATCH_RETRY_S meanwhile: it may well be up, its connection closed while this process could not
                # answer its keepalive pings (frozen, starved), and answering again within a round trip; taking
                # it out meanwhile would answer 503 to whatever came in that round trip, with every worker out.
                if worker.is_serving:
                    leaving = asyncio.get_running_loop().call_later(WATCH_RETRY_S, _out_of_routing, worker, kind)
                continue
            _out_of_routing(worker, kind)
            await asyncio.sleep(WATCH_RETRY_S)
    finally:
        if leaving is not None:
            leaving.cancel()


def _out_of_routing(worker: Worker, kind: str) -> None:
    if worker.is_serving:
        log.warning("%s %s stopped answering health checks; out of routing", kind, worker.address)
    worker.is_serving = False


async def _prepared(worker: Worker, kind: str, before_serving: Sequence[Callable[[Worker], Awaitable[None]]]) -> bool:
    try:
        for prepare in before_serving:
            await prepare(worker)
    except Exception as e:  # whatever it was, the worker lacks what the others have: not routed to
        log.warning("%s %s serves, but could not be given what the others have (%s: %s); out of routing, "
                    "tried again in %g s", kind, worker.address, type(e).__name__, e, WATCH_RETRY_S)
        return False
    return True
