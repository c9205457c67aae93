"""The gateway's channels to N workers of one kind, their health, and least-loaded selection.

A pool follows where its workers are (`follow`): the names it was given, resolved again (a
compose service or a Kubernetes headless service resolves to one address per replica, and
replicas come and go as the pool is scaled), and with discovery the workers of its kind that
heartbeat in the Redis instance registry. Each new address joins (out of routing until its
health check says SERVING); each gone one leaves routing at once, its channel closed once its
requests are done. A source that cannot answer (a name that does not resolve, Redis away)
leaves the pool as it is.
"""
from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.channel import make_channel

log = logging.getLogger("baton.gateway")

WATCH_RETRY_S = 0.5  # how soon a worker whose health stream broke is watched again
IDLE_POLL_S = 0.5  # how often a worker that left is checked for requests still on it
REGISTRY_TIMEOUT_S = 1.0


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

    def __init__(self, workers: Sequence[Worker], kind: str = "worker",
                 make_worker: Callable[[str], Worker] | None = None):
        if not workers and make_worker is None:
            raise ValueError("a worker pool needs at least one worker, or a way to connect to those it finds")
        self.workers = list(workers)
        self.kind = kind
        self._make_worker = make_worker  # how `update` connects to a new address
        self._turn = itertools.count()
        self._health_service: str | None = None  # what `watch_health` watches, once it runs
        self._watchers: dict[Worker, asyncio.Task] = {}
        self._on_removed: list[Callable[[Worker], None]] = []
        self._before_serving: list[Callable[[Worker], Awaitable[None]]] = []
        self._leaving: dict[Worker, asyncio.Task] = {}  # workers gone from the names, until their channel closes

    @classmethod
    def connect(cls, addresses: Sequence[str], stub_class: Callable[[grpc.aio.Channel], Any],
                kind: str = "worker", max_message_bytes: int | None = None) -> WorkerPool:
        """Channels (made here, closed by `close`) to every address, with `stub_class` stubs."""
        def make_worker(address: str) -> Worker:
            channel = make_channel(address) if max_message_bytes is None else make_channel(address, max_message_bytes)
            return Worker(address, channel, stub_class(channel))

        return cls([make_worker(address) for address in addresses], kind, make_worker)

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

    def pick_other(self, gone: Sequence[Worker]) -> Worker | None:
        """The least loaded serving worker but those in `gone` (a request's workers that went away);
        None when there is none."""
        others = [worker for worker in self.workers if worker.is_serving and worker not in gone]
        return self.least_loaded(others) if others else None

    def hold(self, worker: Worker | None = None, num_tokens: int = 0) -> _Held:
        """`worker` (default: the least loaded), counted as busy with `num_tokens` prompt
        tokens for the duration of the block."""
        return _Held(worker or self.pick(), num_tokens)

    def watch_health(self, service_name: str) -> None:
        """Keep every worker's `is_serving` current from its grpc.health.v1 Watch stream;
        a worker whose stream breaks (it died) is out of routing until it serves again."""
        self._health_service = service_name
        for worker in self.workers:
            self._watch(worker)

    def on_removed(self, fn: Callable[[Worker], None]) -> None:
        """Call `fn(worker)` for each worker `update` takes out (what is kept for it can go)."""
        self._on_removed.append(fn)

    def before_serving(self, fn: Callable[[Worker], Awaitable[None]]) -> None:
        """Await `fn(worker)` each time a worker's health turns SERVING, before it is routed to: what it
        must be given that the others were while it was away (adapters loaded at run time). Where `fn`
        raises, the worker stays out of routing until its health is watched again."""
        self._before_serving.append(fn)

    def update(self, addresses: Sequence[str]) -> None:
        """Follow `addresses`: a worker for each new one (out of routing until its health says
        SERVING, where health is watched), and each gone one out of routing at once, its channel
        closed once the requests on it are done. An empty list changes nothing."""
        wanted = list(dict.fromkeys(addresses))
        if not wanted or self._make_worker is None:
            return
        known = {worker.address for worker in self.workers}
        for address in wanted:
            if address not in known:
                worker = self._make_worker(address)
                self.workers.append(worker)
                if self._health_service is not None:
                    self._watch(worker)
                log.info("%s %s joined", self.kind, address)
        for worker in [w for w in self.workers if w.address not in wanted]:
            self.workers.remove(worker)
            worker.is_serving = False
            watcher = self._watchers.pop(worker, None)
            if watcher is not None:
                watcher.cancel()
            for fn in self._on_removed:
                fn(worker)
            self._leaving[worker] = asyncio.ensure_future(self._close_when_idle(worker))
            log.info("%s %s left (%d request(s) still on it)", self.kind, worker.address, worker.num_in_flight)

    async def close(self) -> None:
        tasks = [*self._watchers.values(), *self._leaving.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for worker in [*self.workers, *self._leaving]:
            await worker.channel.close()

    def _watch(self, worker: Worker) -> None:
        worker.is_serving = False
        self._watchers[worker] = asyncio.ensure_future(_watch(worker, self._health_service, self.kind,
                                                              self._before_serving))

    async def _close_when_idle(self, worker: Worker) -> None:
        while worker.num_in_flight:
            await asyncio.sleep(IDLE_POLL_S)
        await worker.channel.close()
        del self._leaving[worker]


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


async def _watch(worker: Worker, service_name: str, kind: str,
                 before_serving: Sequence[Callable[[Worker], Awaitable[None]]]) -> None:
    stub = health_pb2_grpc.HealthStub(worker.channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    while True:
        call = stub.Watch(health_pb2.HealthCheckRequest(service=service_name))
        try:
            async for response in call:
                is_serving = response.status == serving
                if is_serving and not worker.is_serving and not await _prepared(worker, kind, before_serving):
                    call.cancel()  # watched again after a pause: its first answer then tries once more
                    break
                if is_serving != worker.is_serving:
                    log.info("%s %s is %s", kind, worker.address, "serving" if is_serving else "not serving")
                worker.is_serving = is_serving
        except grpc.aio.AioRpcError:
            pass
        if worker.is_serving:
            log.warning("%s %s stopped answering health checks; out of routing", kind, worker.address)
        worker.is_serving = False
        await asyncio.sleep(WATCH_RETRY_S)


async def _prepared(worker: Worker, kind: str, before_serving: Sequence[Callable[[Worker], Awaitable[None]]]) -> bool:
    try:
        for prepare in before_serving:
            await prepare(worker)
    except Exception as e:  # whatever it was, the worker lacks what the others have: not routed to
        log.warning("%s %s serves, but could not be given what the others have (%s: %s); out of routing, "
                    "tried again in %g s", kind, worker.address, type(e).__name__, e, WATCH_RETRY_S)
        return False
    return True


def serving_workers(pools: Sequence[WorkerPool]) -> list[tuple[str, Worker]]:
    """Each serving worker of `pools`, with its pool's kind: what an operator's call to every worker reaches."""
    return [(pool.kind, worker) for pool in pools for worker in pool.workers if worker.is_serving]


def expand_addresses(addresses: Sequence[str]) -> list[str]:
    """Each "host:port", with a host name that resolves to several addresses (a compose
    service with replicas) expanded to one "ip:port" per address; others as given."""
    expanded: list[str] = []
    for address in addresses:
        expanded += _addresses_of(address) or [address]  # one that does not resolve: the channel reports it
    return list(dict.fromkeys(expanded))


def needs_resolving(addresses: Sequence[str]) -> bool:
    """Whether any of `addresses` names its host (rather than giving an IP address)."""
    for address in addresses:
        try:
            ipaddress.ip_address(address.rpartition(":")[0].strip("[]"))
        except ValueError:
            return True
    return False


# Where a pool's workers are now: their addresses, or None when it cannot tell (it is left as it is).
WorkerSource = Callable[[], Awaitable["list[str] | None"]]


async def follow(pool: WorkerPool, sources: Sequence[WorkerSource], every_s: float) -> None:
    """Keep `pool` on the addresses `sources` give together (one per worker), asking them every `every_s` seconds
    until cancelled; while any cannot tell, the pool stays as it is."""
    while True:
        found = [await source() for source in sources]
        if all(addresses is not None for addresses in found):
            addresses = [address for addresses in found for address in addresses]
            if needs_resolving(addresses) and len(addresses) > 1:
                addresses = await asyncio.to_thread(one_per_worker, addresses)
            pool.update(addresses)
        await asyncio.sleep(every_s)


def one_per_worker(addresses: Sequence[str]) -> list[str]:
    """`addresses` less each IP address that one of their names resolves to alone, with its port: a
    worker given by name (`--prefill localhost:50052`) that the registry lists by its address
    (`127.0.0.1:50052`) is one worker, known by its name as the pool first knew it."""
    aliases = set()
    for address in addresses:
        if needs_resolving([address]):
            ips = _ips_of(address)
            if ips is not None and len(ips) == 1:
                aliases.add(f"{ips[0]}:{address.rpartition(':')[2]}")
    return [address for address in addresses if address not in aliases]


def resolved_names(names: Sequence[str]) -> WorkerSource:
    """What `names` resolve to now; None while one does not (a DNS hiccup must not empty a pool)."""
    def resolve() -> list[str] | None:
        found = [_addresses_of(name) for name in names]
        return None if None in found else [address for addresses in found for address in addresses]

    async def source() -> list[str] | None:
        return await asyncio.to_thread(resolve) if needs_resolving(names) else list(names)
    return source


def registered_workers(registry, kind: str, model_key: str) -> WorkerSource:
    """The workers of `kind` serving model `model_key` (its fingerprint, hex) that heartbeat in
    `registry` (an InstanceRegistry); None while Redis does not answer."""
    async def source() -> list[str] | None:
        try:
            async with asyncio.timeout(REGISTRY_TIMEOUT_S):
                live = await registry.instances(kind)
        except Exception as e:  # Redis away: the pool stays as it is, as routing does
            log.debug("cannot list %s instances: %s", kind, e)
            return None
        return [info.address for info in live if info.model_key == model_key]
    return source


def _addresses_of(address: str) -> list[str] | None:
    """One "ip:port" per address `address`'s host name resolves to when there are several, else
    `address` as given; None when it does not resolve."""
    ips = _ips_of(address)
    if ips is None:
        return None
    port = address.rpartition(":")[2]
    return [address] if len(ips) == 1 else [f"{ip}:{port}" for ip in sorted(ips)]


def _ips_of(address: str) -> list[str] | None:
    """The IPv4 addresses `address`'s host resolves to; None when it does not resolve."""
    host, _, port = address.rpartition(":")
    try:
        # IPv4 only: "localhost" must stay one worker, not ::1 and 127.0.0.1 as two.
        infos = socket.getaddrinfo(host, int(port), family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, ValueError):
        return None
    return list(dict.fromkeys(info[4][0] for info in infos)) or None
