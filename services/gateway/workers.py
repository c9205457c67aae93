"""The gateway's channels to N workers of one kind, and least-loaded selection among them."""
from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc

from services.common.channel import make_channel


@dataclass(eq=False)
class Worker:
    """One worker process: its address, channel and stub, and the requests it holds now."""

    address: str
    channel: grpc.aio.Channel
    stub: Any
    num_in_flight: int = field(default=0)


class WorkerPool:
    """Workers of one kind (all prefill or all decode).

    `pick()` returns the worker with the fewest in-flight requests, round-robin among
    ties, so an idle mesh spreads requests evenly instead of piling onto worker 0.
    A request counts as in flight from `pick()` until its `hold` context exits.
    """

    def __init__(self, workers: Sequence[Worker]):
        if not workers:
            raise ValueError("a worker pool needs at least one worker")
        self.workers = list(workers)
        self._turn = itertools.count()

    @classmethod
    def connect(cls, addresses: Sequence[str], stub_class: Callable[[grpc.aio.Channel], Any]) -> WorkerPool:
        """Channels (made here, closed by `close`) to every address, with `stub_class` stubs."""
        workers = []
        for address in addresses:
            channel = make_channel(address)
            workers.append(Worker(address, channel, stub_class(channel)))
        return cls(workers)

    def pick(self) -> Worker:
        least = min(w.num_in_flight for w in self.workers)
        tied = [w for w in self.workers if w.num_in_flight == least]
        return tied[next(self._turn) % len(tied)]

    @contextmanager
    def hold(self) -> Iterator[Worker]:
        """The least-loaded worker, counted as busy for the duration of the block."""
        worker = self.pick()
        worker.num_in_flight += 1
        try:
            yield worker
        finally:
            worker.num_in_flight -= 1

    async def close(self) -> None:
        for worker in self.workers:
            await worker.channel.close()
