"""`RandomRouter`: the prefill router that ignores the prefix index. It answers the same calls
as router.py's `PrefixRouter` (`pick`, `lookup`, `choose`, `record`, `close`), so the gateway
runs with either.
"""
from __future__ import annotations

import random
from collections.abc import Sequence

from services.gateway.prefill_route import NO_LOOKUP, Lookup, Route
from services.gateway.router import ROUTED
from services.gateway.workers import WorkerPool


class RandomRouter:
    """A prefill worker chosen uniformly among the serving ones: the baseline that prefix
    routing is measured against (`--routing random`)."""

    def __init__(self, pool: WorkerPool, seed: int | None = None):
        self.pool = pool
        self._random = random.Random(seed)

    async def pick(self, prompt: Sequence[int]) -> Route:
        route = self.choose(prompt, NO_LOOKUP)
        self.record(route, NO_LOOKUP)
        return route

    async def lookup(self, prompt: Sequence[int], decode_address: str | None = None,
                     lora_name: str | None = None, cache_salt: str | None = None) -> Lookup:
        return NO_LOOKUP

    def choose(self, prompt: Sequence[int], lookup: Lookup) -> Route:
        return Route(self._random.choice(self.pool.serving()), 0, decision="random")

    def record(self, route: Route, lookup: Lookup) -> None:
        ROUTED.labels(route.decision).inc()

    async def close(self) -> None:
        pass
