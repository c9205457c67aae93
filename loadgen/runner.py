"""One load: send the requests on their arrival schedule, at most `max_concurrency` at once.

Fixed concurrency is an infinite rate with a cap (a closed loop: a request goes out as
soon as one finishes); a rate with a cap queues arrivals on the client, as vLLM's
`--max-concurrency` does, so the server never sees more than the cap.
"""
from __future__ import annotations

import asyncio
import math
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

from loadgen.arrivals import arrival_offsets
from loadgen.client import RequestOptions, RequestResult, send_request
from loadgen.workload import RequestSpec


@dataclass(frozen=True)
class LoadPoint:
    """The offered load of one run: `request_rate` in requests/s (inf: all at once)."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"the concurrency must be at least 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"the request rate must be above 0, got {self.request_rate}")

    def describe(self) -> str:
        parts = []
        if math.isfinite(self.request_rate):
            parts.append(f"rate {self.request_rate:g}/s" + (f" (burstiness {self.burstiness:g})"
                                                           if self.burstiness != 1 else ""))
        if self.max_concurrency is not None:
            parts.append(f"concurrency {self.max_concurrency}")
        return ", ".join(parts) or "all at once"


@dataclass(frozen=True)
class RunResult:
    load: LoadPoint
    duration: float  # from the first request sent to the last one done
    results: list[RequestResult]


async def run_load(specs: list[RequestSpec], options: RequestOptions, load: LoadPoint, rng: np.random.Generator,
                   *, headers: dict[str, str] | None = None, progress: bool = False) -> RunResult:
    offsets = arrival_offsets(len(specs), load.request_rate, load.burstiness, rng)
    limit = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    bar = _progress_bar(len(specs), load.describe()) if progress else None
    # No pool limit: the load, not httpx's default of 100 connections, decides what is in flight.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(options.timeout_s), limits=limits,
                                 headers=headers or {}) as client:

        async def one(spec: RequestSpec, run_start: float) -> RequestResult:
            if limit is None:
                result = await send_request(client, options, spec, run_start)
            else:
                async with limit:
                    result = await send_request(client, options, spec, run_start)
            if bar is not None:
                bar.update(1)
            return result

        run_start = time.perf_counter()
        tasks = []
        for spec, offset in zip(specs, offsets):
            # Sleep to each absolute arrival time, so the schedule does not drift with event-loop lag.
            delay = run_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(spec, run_start)))
        try:
            results = await asyncio.gather(*tasks)
        finally:
            if bar is not None:
                bar.close()
        duration = time.perf_counter() - run_start
    return RunResult(load=load, duration=duration, results=list(results))


def _progress_bar(total: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:  # a bar is a nicety; the run goes on without one
        return None
    return tqdm(total=total, desc=label, unit="req", file=sys.stderr, dynamic_ncols=True, leave=False)
