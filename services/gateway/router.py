"""Choosing the prefill worker for a prompt: where its prefix's KV pages already are,
weighed against how much work each worker has queued.

One pipelined Redis round trip per request (`PrefixIndex.match`) says how many of
the prompt's leading blocks each prefill worker holds. The cost of a worker is
Dynamo's form, in blocks: `overlap_weight × blocks it would compute + blocks of
prompts queued on it`; the cheapest wins, ties in turn. SGLang's imbalance guard
sits in front: when the queues differ by more than `balance_abs_tokens` and by a
factor over `balance_rel`, the least loaded worker wins whatever it holds, so one
hot prefix cannot pile every request onto one worker.

Redis is an optimisation, never a dependency: when it does not answer (within
`redis_timeout_s`), routing falls back to load only, a counter and a log line
say so, and Redis is tried again after `redis_retry_s`. The workers republish
what they hold once it is back, so the index rebuilds itself.
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from engine.block_hash import hash_block_chain
from services.gateway.workers import Worker, WorkerPool

log = logging.getLogger("baton.gateway.router")

ROUTED = Counter("baton_router_requests_total", "Prefill routing decisions, by how the worker was chosen",
                 ["decision"])
MATCHED_BLOCKS = Counter("baton_router_matched_blocks_total",
                         "Prompt blocks the chosen prefill worker already held, per the prefix index")
PROMPT_BLOCKS = Counter("baton_router_prompt_blocks_total", "Full prompt blocks routed")
REDIS_UP = Gauge("baton_router_redis_up", "1 while the prefix index in Redis answers, 0 while routing is load-only")
REDIS_FAILURES = Counter("baton_router_redis_failures_total",
                         "Prefix-index lookups that failed (routing fell back to load only)")


@dataclass(frozen=True)
class RouterConfig:
    overlap_weight: float = 1.0      # Dynamo's default: a block to compute costs as much as a queued one
    balance_abs_tokens: int = 4096   # the imbalance guard: queues this many tokens apart...
    balance_rel: float = 2.0         # ...and this many times apart route by load alone
    redis_timeout_s: float = 0.05    # a lookup slower than this is treated as Redis being down
    redis_retry_s: float = 1.0       # how long to route by load alone after a failed lookup
    instances_refresh_s: float = 1.0  # how often the worker → instance-id map is re-read


class PrefixRouter:
    """Picks prefill workers from `pool` using `index` (a PrefixIndex) and `registry` (an
    InstanceRegistry, which maps worker addresses to the instance ids the index uses).
    With `index` None it routes by load alone."""

    def __init__(self, pool: WorkerPool, index, registry, *, fingerprint: bytes, block_size: int,
                 config: RouterConfig = RouterConfig(), redis=None):
        self.pool = pool
        self.redis = redis  # the client behind index and registry, closed with the router
        self.index = index
        self.registry = registry
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.config = config
        self._instance_ids: dict[str, str] = {}  # worker address -> instance id
        self._redis_down_until = 0.0
        self._is_redis_up = index is not None
        self._refresher: asyncio.Task | None = None
        REDIS_UP.set(1 if self._is_redis_up else 0)

    def start(self) -> None:
        if self.registry is not None:
            self._refresher = asyncio.ensure_future(self._refresh_instances())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()

    async def pick(self, prompt: Sequence[int]) -> Worker:
        """The prefill worker for `prompt` (not yet counted as busy: hold it with the pool)."""
        candidates = self.pool.serving()
        hashes = hash_block_chain(prompt, self.block_size, self.fingerprint)
        PROMPT_BLOCKS.inc(len(hashes))
        if len(candidates) == 1:
            ROUTED.labels("only").inc()
            return candidates[0]
        if self._is_imbalanced(candidates):
            ROUTED.labels("balance").inc()
            return self.pool.least_loaded(candidates)
        matched = await self._matched_blocks(hashes, candidates) if hashes else None
        if matched is None:
            ROUTED.labels("load").inc()
            return self.pool.least_loaded(candidates)
        bs = self.block_size
        num_blocks = -(-len(prompt) // bs)

        def cost(worker: Worker) -> float:
            to_compute = num_blocks - matched.get(worker.address, 0)
            return self.config.overlap_weight * to_compute + worker.queued_tokens / bs

        best = min(cost(w) for w in candidates)
        chosen = self.pool.in_turn([w for w in candidates if cost(w) == best])
        hit = matched.get(chosen.address, 0)
        MATCHED_BLOCKS.inc(hit)
        ROUTED.labels("prefix" if hit else "load").inc()
        return chosen

    def _is_imbalanced(self, workers: Sequence[Worker]) -> bool:
        queued = [w.queued_tokens for w in workers]
        most, least = max(queued), min(queued)
        return most - least > self.config.balance_abs_tokens and most > self.config.balance_rel * max(least, 1)

    async def _matched_blocks(self, hashes: list[int], workers: Sequence[Worker]) -> dict[str, int] | None:
        """Leading blocks held, by worker address; None when the index cannot say (routing by load)."""
        if self.index is None or time.monotonic() < self._redis_down_until:
            return None
        by_instance = {self._instance_ids[w.address]: w.address for w in workers if w.address in self._instance_ids}
        if not by_instance:
            return {}
        try:
            held = await asyncio.wait_for(self.index.match(hashes, list(by_instance)), self.config.redis_timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as e:
            self._redis_failed(e)
            return None
        self._redis_answered()
        return {by_instance[instance]: n for instance, n in held.items() if instance in by_instance}

    def _redis_failed(self, e: Exception) -> None:
        REDIS_FAILURES.inc()
        self._redis_down_until = time.monotonic() + self.config.redis_retry_s
        if self._is_redis_up:
            self._is_redis_up = False
            REDIS_UP.set(0)
            log.warning("the prefix index in Redis does not answer (%s: %s); routing by load only, "
                        "retrying every %.1f s", type(e).__name__, e, self.config.redis_retry_s)

    def _redis_answered(self) -> None:
        if not self._is_redis_up:
            self._is_redis_up = True
            REDIS_UP.set(1)
            log.info("the prefix index in Redis answers again; routing by prefix")

    async def _refresh_instances(self) -> None:
        """Keep the address → instance id map current from the registry's live instances."""
        while True:
            try:
                live = await asyncio.wait_for(self.registry.instances("prefill"), 1.0)
                self._instance_ids = {info.address: info.instance_id for info in live}
                if live:  # the workers' page size is the one their hashes are made with
                    self.block_size = live[0].block_size
            except Exception as e:  # Redis down: keep the last map; lookups fail over on their own
                log.debug("cannot list prefill instances: %s", e)
            await asyncio.sleep(self.config.instances_refresh_s)


class RandomRouter:
    """A prefill worker chosen uniformly among the serving ones: the baseline that prefix
    routing is measured against (`--routing random`)."""

    def __init__(self, pool: WorkerPool, seed: int | None = None):
        self.pool = pool
        self._random = random.Random(seed)

    async def pick(self, prompt: Sequence[int]) -> Worker:
        ROUTED.labels("random").inc()
        return self._random.choice(self.pool.serving())

    async def close(self) -> None:
        pass
