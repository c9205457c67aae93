"""Choosing the prefill worker for a prompt: where its prefix's KV pages already are,
weighed against how much work each worker has queued.

The prefix index says how many of the prompt's leading blocks each prefill worker
holds: its copy in this process (`IndexMirror`, kept current from Redis), or while
that is not following Redis, one Redis round trip per request (`PrefixIndex.match`).
The cost of a worker is Dynamo's form, in blocks: `overlap_weight × blocks it would compute + blocks of
prompts queued on it`; the cheapest wins, ties in turn. SGLang's imbalance guard
sits in front: when the queues differ by more than `balance_abs_tokens` and by a
factor over `balance_rel`, the least loaded worker wins whatever it holds, so one
hot prefix cannot pile every request onto one worker. And as SGLang's router does, a
prompt of which no worker holds `cache_threshold` of its blocks goes where the fewest
blocks were routed lately (`RoutedBlocks`; the least loaded of equals): new prefixes
spread evenly over the workers' caches instead of crowding whichever was idle.

kvstore nodes publish the blocks they store into the same index, so the same round
trip also says how many leading blocks the host tier holds, and so do decode workers:
the one the request will decode on is asked about too, so that conditional
disaggregation weighs the part of the prompt it does not hold (`lookup`, then `choose`). Routing still weighs only
what each worker holds itself (the tier is as near to one worker as to another); when
the tier holds more than the chosen worker, the route names the node, and the worker
reads those blocks from it instead of computing them (services/prefill/host_tier.py).

Redis is an optimisation, never a dependency: a lookup that fails or takes over
`redis_timeout_s` routes its request by load; when Redis cannot be reached (or
`redis_down_after_timeouts` lookups in a row were too slow), routing falls back to
load only, a counter and a log line say so, and Redis is tried again after
`redis_retry_s`. The workers republish what they hold once it is back, so the index
rebuilds itself.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Gauge
from redis.exceptions import RedisError

from engine.block_hash import BlockHashChain, request_extra
from services.gateway.index_mirror import IndexMirror
from services.gateway.prefill_route import Lookup, Route
from services.gateway.routed_blocks import RoutedBlocks
from services.gateway.workers import Worker, WorkerPool

log = logging.getLogger("baton.gateway.router")

ROUTED = Counter("baton_router_requests_total", "Prefill routing decisions, by how the worker was chosen",
                 ["decision"])
MATCHED_BLOCKS = Counter("baton_router_matched_blocks_total",
                         "Prompt blocks the chosen prefill worker already held, per the prefix index")
PROMPT_BLOCKS = Counter("baton_router_prompt_blocks_total", "Full prompt blocks routed")
REDIS_UP = Gauge("baton_router_redis_up", "1 while the prefix index in Redis answers, 0 while routing is load-only")
TIER_BLOCKS = Counter("baton_router_host_tier_blocks_total",
                      "Prompt blocks a prefill worker was told to read from a kvstore node instead of computing")
REDIS_FAILURES = Counter("baton_router_redis_failures_total",
                         "Prefix-index lookups that failed (routing fell back to load only)")


@dataclass(frozen=True)
class RouterConfig:
    # A block to compute costs as much as this many queued blocks. Dynamo's default is 1; here
    # queued prompts are batched (chunked prefill runs them together) and a prefix computed
    # again on another worker also evicts that worker's own prefixes. bench/prefix_routing.py:
    # 1 sends a burst's second request for a new prefix to the idle worker (a second copy;
    # hit rate 0.74-0.87), 4 keeps every prefix on one worker (0.92).
    overlap_weight: float = 4.0
    balance_abs_tokens: int = 4096   # the imbalance guard: queues this many tokens apart...
    balance_rel: float = 2.0         # ...and this many times apart route by load alone
    # A lookup slower than this routes its request by load... Not much less: on a busy host the
    # event loop or Redis can be starved for tens of milliseconds, and a prefix recomputed
    # elsewhere costs more than the wait (and a copy of it in another worker's cache).
    redis_timeout_s: float = 0.25
    redis_down_after_timeouts: int = 3  # ...and this many in a row count as Redis being down
    redis_retry_s: float = 1.0       # how long to route by load alone once Redis is down
    instances_refresh_s: float = 1.0  # how often the worker → instance-id map is re-read
    recent_s: float = 2.0            # a routed prompt's blocks count as on its worker this long...
    recent_max_blocks: int = 100_000  # ...for at most this many blocks, least recent forgotten first
    cache_threshold: float = 0.5     # SGLang's: held by no worker in this share, a prompt spreads...
    routed_window_s: float = 60.0    # ...by the blocks routed to each worker within this long


class PrefixRouter:
    """Picks prefill workers from `pool` using `index` (a PrefixIndex) and `registry` (an
    InstanceRegistry, which maps worker addresses to the instance ids the index uses).
    With `index` None it routes by load alone."""

    def __init__(self, pool: WorkerPool, index, registry, *, fingerprint: bytes, block_size: int,
                 config: RouterConfig = RouterConfig(), redis=None, mirror: IndexMirror | None = None,
                 decode: WorkerPool | None = None):
        """`decode`: the decode pool, whose workers' free pages the router keeps from the registry."""
        self.pool = pool
        self.decode = decode
        self.redis = redis  # the client behind index and registry, closed with the router
        self.index = index
        self.mirror = mirror  # the index in this process, asked instead of Redis while it follows it
        self._mirroring: asyncio.Task | None = None
        self.registry = registry
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.config = config
        self._instance_ids: dict[str, str] = {}  # prefill worker address -> instance id
        self._decode_ids: dict[str, str] = {}  # decode worker address -> instance id
        self._kvstores: dict[str, str] = {}  # kvstore node instance id -> address
        self._routed = RoutedBlocks(config.routed_window_s, config.recent_max_blocks)
        self._redis_down_until = 0.0
        self._timeouts_in_a_row = 0
        self._is_redis_up = index is not None
        self._refresher: asyncio.Task | None = None
        self._is_closing = False
        REDIS_UP.set(1 if self._is_redis_up else 0)

    def start(self) -> None:
        if self.registry is not None:
            self._refresher = asyncio.ensure_future(self._refresh_instances())
        if self.mirror is not None:
            self._mirroring = asyncio.ensure_future(self.mirror.run())

    async def close(self) -> None:
        # The flags as well as the cancels: Python 3.11's wait_for and asyncio.timeout can swallow a
        # cancellation that lands as the call they bound completes, and a loop would then run forever.
        if self._mirroring is not None:
            self.mirror.is_stopping = True
            self._mirroring.cancel()
            await asyncio.gather(self._mirroring, return_exceptions=True)
        if self._refresher is not None:
            self._is_closing = True
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        if self.redis is not None:
            await self.redis.aclose()

    async def pick(self, prompt: Sequence[int]) -> Route:
        """The prefill worker for `prompt`, and how many of its tokens it is thought to hold
        (not yet counted as busy: hold it with the pool, for the tokens left to compute),
        recorded as routed there."""
        lookup = await self.lookup(prompt)
        route = self.choose(prompt, lookup)
        self.record(route, lookup)
        return route

    async def lookup(self, prompt: Sequence[int], decode_address: str | None = None,
                     lora_name: str | None = None, cache_salt: str | None = None) -> Lookup:
        """How many of `prompt`'s leading blocks each prefill worker, each kvstore node and the
        decode worker at `decode_address` hold, computed with LoRA adapter `lora_name` (None: the
        model) under `cache_salt` (None: unsalted): one round trip, made only when there is a
        choice to make (several prefill workers, a kvstore node, or a decode worker that may
        prefill). The prompt is hashed only as far as the match reads (up to the first block no
        one holds): `record` hashes the rest, after the prompt is sent."""
        candidates = self.pool.serving()
        hashes = BlockHashChain(prompt, self.block_size, request_extra(self.fingerprint, lora_name, cache_salt))
        decode_id = self._decode_ids.get(decode_address) if decode_address else None
        if not hashes or not (len(candidates) > 1 or self._kvstores or decode_id):
            return Lookup(hashes, None)
        return await self._matched_blocks(hashes, candidates, decode_id, len(prompt))

    def choose(self, prompt: Sequence[int], lookup: Lookup) -> Route:
        """The prefill worker for `prompt` given what `lookup` found (see `pick`); `record` it
        once the prompt is on its way (the bookkeeping is off the request's critical path)."""
        candidates = self.pool.serving()
        hashes, matched, tier = lookup.hashes, lookup.matched, lookup.tier
        if matched is not None:
            for address, n in self._routed.leading(hashes, self.config.recent_s).items():
                matched[address] = max(matched.get(address, 0), n)
        held = (lambda w: matched.get(w.address, 0)) if matched else (lambda w: 0)  # noqa: E731
        if len(candidates) == 1:
            decision, chosen = "only", candidates[0]
        elif self._is_imbalanced(candidates):
            decision, chosen = "balance", self.pool.least_loaded(candidates)
        elif matched is None:
            decision, chosen = "load", self.pool.least_loaded(candidates)
        elif max(held(w) for w in candidates) < self.config.cache_threshold * len(hashes):
            # Cache balance, not load, places a new prefix (load has the imbalance guard): by
            # queues, the worker that happens to be idle now would take one prefix after another.
            decision = "spread"
            chosen = min(candidates, key=lambda w: (self._routed.count(w.address), w.queued_tokens))
        else:
            bs = self.block_size
            num_blocks = -(-len(prompt) // bs)

            def cost(worker: Worker) -> float:
                # Queued work counts what is left to compute, not whole prompts: a request whose
                # prefix is cached costs its worker almost nothing, and must not push the next
                # request for that prefix onto a worker that would compute all of it.
                return self.config.overlap_weight * (num_blocks - held(worker)) + worker.queued_tokens / bs

            best = min(cost(w) for w in candidates)
            chosen = self.pool.in_turn([w for w in candidates if cost(w) == best])
            decision = "prefix" if held(chosen) else "load"
        num_held = held(chosen)
        if tier is not None and tier[1] > num_held:
            return Route(chosen, min(len(prompt), num_held * self.block_size), tier[0], tier[1], decision)
        return Route(chosen, min(len(prompt), num_held * self.block_size), decision=decision)

    def record(self, route: Route, lookup: Lookup) -> None:
        """Count `route` and remember its blocks as routed to its worker (`RoutedBlocks`): what
        the next prompts are routed by."""
        PROMPT_BLOCKS.inc(len(lookup.hashes))
        num_held = route.num_cached_tokens // self.block_size
        MATCHED_BLOCKS.inc(num_held)
        ROUTED.labels(route.decision).inc()
        if route.host_tier_blocks:
            TIER_BLOCKS.inc(route.host_tier_blocks - num_held)
        self._routed.add(route.worker.address, lookup.hashes)

    def _is_imbalanced(self, workers: Sequence[Worker]) -> bool:
        queued = [w.queued_tokens for w in workers]
        most, least = max(queued), min(queued)
        return most - least > self.config.balance_abs_tokens and most > self.config.balance_rel * max(least, 1)

    async def _matched_blocks(self, hashes: Sequence[int], workers: Sequence[Worker], decode_id: str | None,
                              num_tokens: int) -> Lookup:
        """Leading blocks held, by prefill worker address (`matched` None when the index cannot
        say: routing by load), the kvstore node holding the most of them (None: none holds any),
        and how many of the prompt's `num_tokens` decode instance `decode_id` holds."""
        if self.index is None:
            return Lookup(hashes, None)
        by_instance = {self._instance_ids[w.address]: w.address for w in workers if w.address in self._instance_ids}
        kvstores = dict(self._kvstores)
        asked = [*by_instance, *kvstores, *([decode_id] if decode_id else [])]
        if not asked:
            return Lookup(hashes, {})
        if self.mirror is not None and self.mirror.is_synced:  # it follows Redis, so Redis answers
            held = self.mirror.match(hashes, asked)
        elif time.monotonic() < self._redis_down_until:
            return Lookup(hashes, None)
        else:
            try:
                async with asyncio.timeout(self.config.redis_timeout_s):
                    held = await self.index.match(hashes, asked)
            except (RedisError, OSError, TimeoutError) as e:
                self._redis_failed(e)
                return Lookup(hashes, None)
        self._redis_answered()
        tier = max(((kvstores[i], n) for i, n in held.items() if i in kvstores and n > 0),
                   key=lambda entry: entry[1], default=None)
        decode_blocks = held.get(decode_id, 0) if decode_id else 0
        return Lookup(hashes, {by_instance[instance]: n for instance, n in held.items() if instance in by_instance},
                      tier, min(num_tokens, decode_blocks * self.block_size))

    def _redis_failed(self, e: Exception) -> None:
        """A connection error means Redis is down; a slow answer only costs its request the
        prefix match, unless they keep coming: one lookup held up on a busy host (the event
        loop or Redis starved for CPU) must not send a whole second of requests by load alone,
        scattering prefixes over workers that then evict each other's."""
        REDIS_FAILURES.inc()
        if isinstance(e, TimeoutError):
            self._timeouts_in_a_row += 1
            if self._timeouts_in_a_row < self.config.redis_down_after_timeouts:
                return
        self._timeouts_in_a_row = 0
        self._redis_down_until = time.monotonic() + self.config.redis_retry_s
        if self._is_redis_up:
            self._is_redis_up = False
            REDIS_UP.set(0)
            log.warning("the prefix index in Redis does not answer (%s: %s); routing by load only, "
                        "retrying every %.1f s", type(e).__name__, e, self.config.redis_retry_s)

    def _redis_answered(self) -> None:
        self._timeouts_in_a_row = 0
        if not self._is_redis_up:
            self._is_redis_up = True
            REDIS_UP.set(1)
            log.info("the prefix index in Redis answers again; routing by prefix")

    def _know_decode_room(self, free_tokens: dict[str, int]) -> None:
        """Each decode worker's room, by address (one not listed: not known)."""
        if self.decode is not None:
            for worker in self.decode.workers:
                worker.free_tokens = free_tokens.get(worker.address)

    async def _refresh_instances(self) -> None:
        """Keep the address → instance id maps current from the registry's live instances."""
        while not self._is_closing:
            try:
                async with asyncio.timeout(1.0):
                    live = await self.registry.instances("prefill")
                self._instance_ids = {info.address: info.instance_id for info in live}
                if live:  # the workers' page size is the one their hashes are made with
                    self.block_size = live[0].block_size
                async with asyncio.timeout(1.0):
                    nodes = await self.registry.instances("kvstore")
                self._kvstores = {info.instance_id: info.address for info in nodes}
                async with asyncio.timeout(1.0):
                    decoders = await self.registry.instances("decode")
                self._decode_ids = {info.address: info.instance_id for info in decoders}
                self._know_decode_room({info.address: info.free_pages * info.block_size for info in decoders})
            except Exception as e:  # Redis down: keep the last map; lookups fail over on their own
                log.debug("cannot list prefill instances: %s", e)
                self._know_decode_room({})  # not kept: a worker full then would be passed over long after
            await asyncio.sleep(self.config.instances_refresh_s)
