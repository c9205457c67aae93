"""`InstancePublisher`: an instance's background task that keeps Redis told what it is and holds.

Every `interval_s` (0.25 s, at most a third of the registry TTL) it reads a small
snapshot of its `Holdings` (load figures, and the block hashes added and evicted
since the last read: a worker's prefix cache, read on its engine thread, or a kvstore
node's host tier), heartbeats its `InstanceInfo` (services/common/registry.py)
and publishes or removes those hashes (services/kvstore/prefix_index.py): routers see
fresh load and a new prefix within a fraction of a second. Every `index_ttl_s / 3` it
also refreshes every hash it holds, so none lapses while held. An eviction therefore
leaves the index within one interval; a worker that dies leaves entries that lapse
within one index TTL and drops out of the registry within one registry TTL.

Redis is an optimization, never a dependency: when it cannot be reached the worker
logs one warning, keeps serving and tries again each interval; once it answers
again, everything held is republished (a restarted Redis starts empty: the index is
rebuilt from the workers), as it is when a heartbeat finds Redis no longer knew this
instance (flushed, or failed over to an empty replica). Evictions during an outage
(a partition, a stalled Redis that kept its data) are removed then too: they are kept
while Redis is away, but only for one index TTL, after which every entry the worker
did not refresh has lapsed anyway (which bounds what is kept by the churn of one TTL).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.common.addresses import advertised_address, instance_id
from services.common.engine_errors import EngineDeadError
from services.common.redis_client import connect_redis
from services.common.registry import InstanceInfo, InstanceRegistry
from services.kvstore.prefix_index import PrefixIndex

if TYPE_CHECKING:  # a kvstore node publishes too, and imports no engine
    from engine.llm_engine import LLMEngine
    from services.common.engine_loop import EngineLoop

log = logging.getLogger("baton.index_publisher")


# Block hashes by model key (the hex model fingerprint): a kvstore node holds any model's pages.
HashesByModel = dict[str, list[int]]


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What one tick reads."""

    queued_tokens: int
    free_pages: int
    total_pages: int
    running: int
    waiting: int
    added: HashesByModel
    removed: HashesByModel
    held: HashesByModel | None  # every held hash, when a full refresh is due


class Holdings(Protocol):
    """What an instance holds and how loaded it is, as its publisher reads them."""

    async def start_recording(self) -> None:
        """From now on, record the hashes added and evicted (for `snapshot`)."""

    async def snapshot(self, with_held: bool) -> Snapshot:
        """Load figures and the changes since the last snapshot; with `with_held`, everything held."""

    async def held(self) -> HashesByModel:
        """Every hash held now."""


class EngineHoldings:
    """A worker's prefix cache and scheduler, read on its engine thread."""

    def __init__(self, engine_loop: EngineLoop, model_key: str) -> None:
        self.engine_loop = engine_loop
        self.model_key = model_key

    async def start_recording(self) -> None:
        await self.engine_loop.call(lambda engine: engine.block_manager.enable_cache_events())

    async def snapshot(self, with_held: bool) -> Snapshot:
        return await self.engine_loop.call(lambda engine: self._read(engine, with_held))

    async def held(self) -> HashesByModel:
        return {self.model_key: await self.engine_loop.call(lambda engine: engine.block_manager.cached_hashes())}

    def _read(self, engine: LLMEngine, with_held: bool) -> Snapshot:
        """On the engine thread: O(requests queued and running) plus, with `with_held`, one
        copy of the cached hashes."""
        scheduler, blocks = engine.scheduler, engine.block_manager
        added, removed = blocks.drain_cache_events()
        return Snapshot(
            queued_tokens=sum(seq.num_uncomputed_tokens for seq in (*scheduler.waiting, *scheduler.running)),
            free_pages=blocks.num_free_blocks, total_pages=blocks.num_blocks,
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            added={self.model_key: added}, removed={self.model_key: removed},
            held={self.model_key: blocks.cached_hashes()} if with_held else None,
        )


class InstancePublisher:
    """Heartbeats `identity` (its load fields filled in each tick from `holdings`) and, with
    `publish_blocks`, publishes the hashes `holdings` holds. `start` once the instance serves
    (a worker: once warm, since a heartbeat puts it into routing); `close` before what
    `holdings` reads stops (a worker's engine loop)."""

    def __init__(self, redis: Redis, holdings: Holdings, identity: InstanceInfo, *,
                 publish_blocks: bool, registry_ttl_s: float = 3.0, index_ttl_s: float = 30.0,
                 interval_s: float = 0.25) -> None:
        self.redis = redis
        self.holdings = holdings
        self.identity = identity
        self.publish_blocks = publish_blocks
        self.registry = InstanceRegistry(redis, registry_ttl_s)
        self.index_ttl_s = index_ttl_s
        self._indexes: dict[str, PrefixIndex] = {}
        self.interval_s = min(interval_s, registry_ttl_s / 3)
        self.refresh_s = index_ttl_s / 3
        self._last_refresh = float("-inf")
        self._is_down = False
        # Evicted while Redis was away, by model key, and since when it is away (monotonic).
        self._unsent_removed: dict[str, set[int]] = {}
        self._down_since = 0.0
        self._closing = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None

    async def start(self, stop: asyncio.Event | None = None) -> None:
        """Heartbeat from now on. Once `stop` is set (the service's SIGTERM), leave the registry
        and the index at once, before in-flight calls drain, so routers stop choosing this worker."""
        if self.publish_blocks:
            await self.holdings.start_recording()
        self._task = asyncio.create_task(self._run(), name=f"publisher-{self.identity.instance_id}")
        if stop is not None:
            self._watch = asyncio.create_task(self._close_on(stop))

    async def close(self) -> None:
        """Stop heartbeating and leave (if `stop` did not already), then close the client."""
        self._closing.set()
        if self._task is not None:
            await self._task
        if self._watch is not None:
            self._watch.cancel()
        await self.redis.aclose()

    def _index(self, model_key: str) -> PrefixIndex:
        if model_key not in self._indexes:
            self._indexes[model_key] = PrefixIndex(self.redis, model_key, self.index_ttl_s)
        return self._indexes[model_key]

    async def _publish(self, added: HashesByModel) -> None:
        for model_key, hashes in added.items():
            if hashes:
                await self._index(model_key).publish(self.identity.instance_id, hashes)

    async def _remove(self, removed: HashesByModel) -> None:
        for model_key, hashes in removed.items():
            if hashes:
                await self._index(model_key).remove(self.identity.instance_id, hashes)

    async def _close_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._closing.set()

    async def _run(self) -> None:
        while not self._closing.is_set():
            started = time.monotonic()
            try:
                await self.tick()
            except Exception:  # an engine-side surprise: keep the worker serving, try again next tick
                log.exception("publishing %s failed", self.identity.instance_id)
            try:
                async with asyncio.timeout(max(0.0, self.interval_s - (time.monotonic() - started))):
                    await self._closing.wait()
            except TimeoutError:
                pass
        await self._leave()

    async def _leave(self, timeout_s: float = 1.0) -> None:
        """Best effort: an instance that cannot be removed lapses within one TTL anyway."""
        instance_id = self.identity.instance_id

        async def leave() -> None:
            await self.registry.remove(self.identity.kind, instance_id)
            if self.publish_blocks:
                await self._remove(await self.holdings.held())

        try:
            async with asyncio.timeout(timeout_s):
                await leave()
        except (RedisError, OSError, TimeoutError, EngineDeadError) as e:
            log.warning("could not remove %s from Redis (its entries will lapse): %r", instance_id, e)

    async def tick(self) -> None:
        """One heartbeat: read the holdings, then tell Redis (one pipelined call per part)."""
        is_refresh = self.publish_blocks and (self._is_down or time.monotonic() - self._last_refresh >= self.refresh_s)
        snap = await self.holdings.snapshot(is_refresh)
        info = dataclasses.replace(self.identity, queued_tokens=snap.queued_tokens, free_pages=snap.free_pages,
                                   total_pages=snap.total_pages, running=snap.running, waiting=snap.waiting)
        instance_id = info.instance_id
        try:
            is_unknown = await self.registry.heartbeat(info)
            if self.publish_blocks:
                held = snap.held
                if held is None and is_unknown:  # Redis lost our entries without our noticing (a flush)
                    held = await self.holdings.held()
                    is_refresh = True
                await self._remove(self._with_unsent(snap.removed, held))
                await self._publish(snap.added if held is None else held)
        except (RedisError, OSError) as e:
            if not self._is_down:
                log.warning("Redis unreachable (%s): %s keeps serving and retries every %.1f s",
                            e, instance_id, self.interval_s)
                self._is_down, self._down_since = True, time.monotonic()
            # What this tick added is covered by the full republish on recovery; what it evicted is kept.
            if self.publish_blocks:
                self._keep_unsent(snap)
            return
        if is_refresh:
            self._last_refresh = time.monotonic()
        self._unsent_removed.clear()
        if self._is_down:
            log.info("Redis reachable again: %s heartbeats again and republished its prefix cache", instance_id)
            self._is_down = False

    def _keep_unsent(self, snap: Snapshot) -> None:
        if time.monotonic() - self._down_since >= self.index_ttl_s:
            self._unsent_removed.clear()  # away a whole TTL: whatever this worker published has lapsed
            return
        for model_key, hashes in snap.removed.items():
            self._unsent_removed.setdefault(model_key, set()).update(hashes)
        for model_key, hashes in snap.added.items():  # evicted, then cached again: not to remove
            self._unsent_removed.get(model_key, set()).difference_update(hashes)

    def _with_unsent(self, removed: HashesByModel, held: HashesByModel | None) -> HashesByModel:
        """This tick's evictions and those kept from an outage, less anything held now."""
        if not self._unsent_removed:
            return removed
        merged = {model_key: set(hashes) for model_key, hashes in removed.items()}
        for model_key, hashes in self._unsent_removed.items():
            merged.setdefault(model_key, set()).update(hashes)
        for model_key, hashes in (held or {}).items():
            merged.get(model_key, set()).difference_update(hashes)
        return {model_key: list(hashes) for model_key, hashes in merged.items()}


def publisher_for(kind: str, config: Any, port: int | None, engine_loop: EngineLoop, *, model_key: str,
                  block_size: int, publish_blocks: bool) -> InstancePublisher | None:
    """The publisher a worker's config asks for (`redis_url`, `instance_id`, `host`, `registry_ttl_s`,
    `index_ttl_s`), bound to `port`; None without --redis."""
    return holdings_publisher(kind, config, port, EngineHoldings(engine_loop, model_key), model_key=model_key,
                              block_size=block_size, publish_blocks=publish_blocks)


def holdings_publisher(kind: str, config: Any, port: int | None, holdings: Holdings, *, model_key: str,
                       block_size: int, publish_blocks: bool) -> InstancePublisher | None:
    """`publisher_for` over any `Holdings` (a kvstore node's: model_key "", block_size 0)."""
    if not config.redis_url:
        return None
    if port is None:
        raise RuntimeError("the server's port is not known yet: start publishing once it is bound")
    address = advertised_address(config.host, port)
    identity = InstanceInfo(instance_id=instance_id(kind, address, config.instance_id), kind=kind, address=address,
                            model_key=model_key, block_size=block_size)
    return InstancePublisher(connect_redis(config.redis_url), holdings, identity, publish_blocks=publish_blocks,
                             registry_ttl_s=config.registry_ttl_s, index_ttl_s=config.index_ttl_s)
