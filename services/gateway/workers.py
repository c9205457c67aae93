"""The gateway's channels to N workers of one kind, their health, and least-loaded selection.

A pool follows the addresses it is given (`update`; worker_discovery finds them): each new
address joins (out of routing until its health check says SERVING, as worker_health watches);
each gone one leaves routing at once, its channel closed once its requests are done.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.channel import make_channel
from services.gateway.worker_health import watch_worker

log = logging.getLogger("baton.gateway")

IDLE_POLL_S = 0.5  # how often a worker that left is checked for requests still on it


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
    # Tokens its free KV pages hold, as its last heartbeat in the instance registry said (a decode worker's,
    # kept by the router); None where not known.
    free_tokens: int | None = None
    # The most tokens of one request its KV pool holds, where fewer than its context (a decode worker's, from
    # its Describe: kv_capacity.py); None where it holds the whole context, or is not known.
    kv_capacity_tokens: int | None = None


def _with_room(workers: list[Worker], num_tokens: int) -> list[Worker]:
    """Those of `workers` not known to lack room for `num_tokens` (all of them where none has it): routing
    counts requests, and one decode worker may be full of long contexts while another has room."""
    if not num_tokens:
        return workers
    return [w for w in workers if w.free_tokens is None or w.free_tokens >= num_tokens] or workers


def _holding(workers: list[Worker], num_tokens: int) -> list[Worker]:
    """Those of `workers` whose KV pool is not known to be too small for a request of `num_tokens` (all of
    them where none is: the request is then refused, kv_capacity.py)."""
    if not num_tokens:
        return workers
    return [w for w in workers if w.kv_capacity_tokens is None or w.kv_capacity_tokens >= num_tokens] or workers


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

    def pick(self, num_tokens: int = 0, most_tokens: int = 0) -> Worker:
        """The least loaded serving worker, of those with room for `num_tokens` where some are known to have it,
        and whose KV pool can hold a request of `most_tokens` (its prompt and all it may generate) where some can."""
        return self.least_loaded(_with_room(_holding(self.serving(), most_tokens), num_tokens))

    def pick_other(self, gone: Sequence[Worker], num_tokens: int = 0) -> Worker | None:
        """As `pick`, but for those in `gone` (a request's workers that went away, or had no room);
        None when there is none."""
        others = [worker for worker in self.workers if worker.is_serving and worker not in gone]
        return self.least_loaded(_with_room(others, num_tokens)) if others else None

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
        self._watchers[worker] = asyncio.ensure_future(watch_worker(worker, self._health_service, self.kind,
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


def serving_workers(pools: Sequence[WorkerPool]) -> list[tuple[str, Worker]]:
    """Each serving worker of `pools`, with its pool's kind: what an operator's call to every worker reaches."""
    return [(pool.kind, worker) for pool in pools for worker in pool.workers if worker.is_serving]
