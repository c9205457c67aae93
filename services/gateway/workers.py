"""The gateway's channels to N workers of one kind, their health, and least-loaded selection."""
from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channel import make_channel

log = logging.getLogger("baton.gateway")

WATCH_RETRY_S = 0.5  # how soon a worker whose health stream broke is watched again


class NoHealthyWorkerError(RuntimeError):
    """No worker of a kind reports SERVING now (HTTP 503)."""


@dataclass(eq=False)
class Worker:
    """One worker process: its address, channel and stub, and the requests it holds now."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    num_in_flight: int = field(default=0)
    queued_tokens: int = field(default=0)  # prompt tokens of the requests in flight on it
    is_serving: bool = True  # kept current by WorkerPool.watch_health where that runs


class WorkerPool:
    """Workers of one kind (all prefill or all decode).

    `pick()` returns the serving worker with the least queued work, in turn among
    ties, so an idle mesh spreads requests evenly instead of piling onto worker 0. A
    request counts as in flight while its `hold` context lasts.
    """

    def __init__(self, workers: Sequence[Worker], kind: str = "worker"):
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = list(workers)
        self.kind = kind
        self._turn = itertools.count()
        self._watchers: list[asyncio.Task] = []

    @classmethod
    def connect(cls, addresses: Sequence[str], stub_class: Callable[[grpc.aio.Channel], Any],
                kind: str = "worker", max_message_bytes: int | None = None) -> WorkerPool:
        """Channels (made here, closed by `close`) to every address, with `stub_class` stubs."""
        workers = []
        for address in addresses:
            channel = make_channel(address) if max_message_bytes is None else make_channel(address, max_message_bytes)
            workers.append(Worker(address, channel, stub_class(channel)))
        return cls(workers, kind)

    @property
    def num_serving(self) -> int:
        return sum(w.is_serving for w in self.workers)

    def serving(self) -> list[Worker]:
        serving = [w for w in self.workers if w.is_serving]
        if not serving:
            raise NoHealthyWorkerError(f"no {self.kind} worker is serving ({len(self.workers)} known)")
        return serving

    def in_turn(self, tied: Sequence[Worker]) -> Worker:
        """One of `tied`, taking turns, so equals share the work instead of piling onto the first."""
        return tied[next(self._turn) % len(tied)]

    def least_loaded(self, workers: Sequence[Worker]) -> Worker:
        """Fewest queued prompt tokens, then fewest requests in flight; ties in turn."""
        if len(workers) == 1:  # no choice to make (every request's path asks, for its decode worker)
            return workers[0]
        least = min((w.queued_tokens, w.num_in_flight) for w in workers)
        return self.in_turn([w for w in workers if (w.queued_tokens, w.num_in_flight) == least])

    def pick(self) -> Worker:
        return self.least_loaded(self.serving())

    def hold(self, worker: Worker | None = None, num_tokens: int = 0) -> _Held:
        """`worker` (default: the least loaded), counted as busy with `num_tokens` prompt
        tokens for the duration of the block."""
        return _Held(worker or self.pick(), num_tokens)

    def watch_health(self, service_name: str) -> None:
        """Keep every worker's `is_serving` current from its grpc.health.v1 Watch stream;
        a worker whose stream breaks (it died) is out of routing until it serves again."""
        for worker in self.workers:
            worker.is_serving = False
            self._watchers.append(asyncio.ensure_future(_watch(worker, service_name, self.kind)))

    async def close(self) -> None:
        for task in self._watchers:
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        for worker in self.workers:
            await worker.channel.close()


class _Held:
    """A worker counted as busy while the block runs (a class, not a generator: it is on the
    path of every request, twice)."""

    __slots__ = ("worker", "num_tokens")

    def __init__(self, worker: Worker, num_tokens: int) -> None:
        self.worker = worker
        self.num_tokens = num_tokens

    def __enter__(self) -> Worker:
        self.worker.num_in_flight += 1
        self.worker.queued_tokens += self.num_tokens
        return self.worker

    def __exit__(self, *exc_info) -> None:
        self.worker.num_in_flight -= 1
        self.worker.queued_tokens -= self.num_tokens


async def _watch(worker: Worker, service_name: str, kind: str) -> None:
    stub = health_pb2_grpc.HealthStub(worker.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    while True:
        try:
            async for response in stub.Watch(health_pb2.HealthCheckRequest(service=service_name)):
                is_serving = response.status == serving
                if is_serving != worker.is_serving:
                    log.info("%s %s is %s", kind, worker.address, "serving" if is_serving else "not serving")
                worker.is_serving = is_serving
        except grpc.aio.AioRpcError:
            pass
        if worker.is_serving:
            log.warning("%s %s stopped answering health checks; out of routing", kind, worker.address)
        worker.is_serving = False
        await asyncio.sleep(WATCH_RETRY_S)


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """Each "host:port", with a host name that resolves to several addresses (a compose
    service with replicas) expanded to one "ip:port" per address; others as given."""
    expanded: list[str] = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            # IPv4 only: "localhost" must stay one worker, not ::1 and 127.0.0.1 as two.
            infos = socket.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
        except (socket.gaierror, ValueError):
            expanded.append(address)  # let the channel report it
            continue
        ips = list(dict.fromkeys(info[4][0] for info in infos))
        if len(ips) <= 1:
            expanded.append(address)
        else:
            expanded.extend(f"{ip}:{port}" for ip in sorted(ips))
    return list(dict.fromkeys(expanded))
