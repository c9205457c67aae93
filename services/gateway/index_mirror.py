"""`IndexMirror`: the prefix index (services/kvstore/prefix_index.py), copied into the
router's process and kept current from the index's channel, so that matching a prompt
is a walk over a dict instead of a Redis round trip on the request's path (about 1 ms
here, most of it waking an idle Redis). Dynamo's KV router keeps its radix tree in
memory from the workers' KV events the same way; Redis stays the record that a new
router, or one that lost its connection, starts from.

Kept current: subscribed first, then every index key read (`resync`), then each
announced change applied in order; read again whenever the client resubscribes after
a reconnection of its own. A change announced while the keys are being read
is applied again after them; a change per (block, instance) is a set or a delete, so
replaying a suffix of them over a state that already has them ends in the same state.

While it is not following the channel (before the first resync, and from a lost
connection until the next resync), `is_synced` is False and the router asks Redis
itself. Members lapse by their expiry as they do in Redis; lapsed ones are purged
every `purge_s`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Sequence

from redis.asyncio import Redis
from redis.exceptions import RedisError

from services.kvstore.prefix_index import PrefixIndex

log = logging.getLogger("baton.gateway.index_mirror")

RESYNC_BATCH = 1000  # keys read per pipelined round trip while resyncing


class IndexMirror:
    def __init__(self, redis: Redis, index: PrefixIndex, *, retry_s: float = 1.0, ping_s: float = 5.0,
                 purge_s: float = 30.0) -> None:
        self.redis = redis
        self.index = index
        self.retry_s = retry_s
        self.ping_s = ping_s  # a silent connection is checked this often, so a dead one is noticed
        self.purge_s = purge_s
        self.is_synced = False
        self.is_stopping = False
        self._held: dict[int, dict[str, float]] = {}  # block hash -> {instance id: expiry (unix seconds)}

    def match(self, block_hashes: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        """As `PrefixIndex.match`: for each of `instance_ids`, how many leading blocks of
        `block_hashes` it holds unexpired."""
        counts = dict.fromkeys(instance_ids, 0)
        if not block_hashes or block_hashes[0] not in self._held:  # a new prefix: no walk
            return counts
        now = time.time()
        alive = list(counts)
        for depth, block_hash in enumerate(block_hashes, start=1):
            holders = self._held.get(block_hash)
            if not holders:
                break
            alive = [i for i in alive if holders.get(i, 0.0) > now]
            if not alive:
                break
            for instance_id in alive:
                counts[instance_id] = depth
        return counts

    async def run(self) -> None:
        """Follow the index until cancelled, starting over after a lost connection. Set `is_stopping`
        before cancelling: Python 3.11's asyncio.timeout, which redis-py reads under, can swallow a
        cancellation that lands as it expires, and the loop then ends at its next turn instead."""
        while not self.is_stopping:
            try:
                await self._follow()
            except (RedisError, OSError) as e:
                if self.is_synced:
                    log.warning("lost the prefix index's channel (%s: %s); asking Redis per request until "
                                "it is back", type(e).__name__, e)
                self.is_synced = False
            await asyncio.sleep(self.retry_s)

    async def _follow(self) -> None:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(self.index.channel)
            await self._resync()
            self.is_synced = True
            log.info("prefix index mirrored: %d blocks", len(self._held))
            last_heard = last_purge = time.monotonic()
            subscriptions = 0
            while not self.is_stopping:
                message = await pubsub.get_message(timeout=1.0)
                now = time.monotonic()
                if message is not None:
                    if message["type"] == "message":
                        self._apply_or_skip(message["data"])
                    elif message["type"] == "subscribe":
                        subscriptions += 1
                        if subscriptions > 1:
                            # redis-py reconnected and subscribed again by itself: what was
                            # announced meanwhile is lost, so the copy is read again.
                            log.info("the prefix index's channel reconnected; reading the index again")
                            await self._resync()
                    last_heard = now
                elif now - last_heard > self.ping_s:
                    await pubsub.ping()
                    last_heard = now
                if now - last_purge > self.purge_s:
                    self.purge()
                    last_purge = now
        finally:
            self.is_synced = False
            await pubsub.aclose()

    async def _resync(self) -> None:
        """Replace the copy with every index key as Redis holds it now."""
        held: dict[int, dict[str, float]] = {}
        prefix = self.index.key_prefix
        keys = [key async for key in self.redis.scan_iter(match=f"{prefix}*", count=RESYNC_BATCH)]
        for start in range(0, len(keys), RESYNC_BATCH):
            batch = keys[start:start + RESYNC_BATCH]
            pipe = self.redis.pipeline(transaction=False)
            for key in batch:
                pipe.zrange(key, 0, -1, withscores=True)
            for key, members in zip(batch, await pipe.execute()):
                if members:
                    text = key.decode() if isinstance(key, bytes) else key
                    held[int(text[len(prefix):], 16)] = {_text(m): score for m, score in members}
        self._held = held

    def _apply_or_skip(self, announcement: bytes | str) -> None:
        try:
            self.apply(announcement)
        except (ValueError, KeyError, AttributeError) as e:  # not one of ours: nothing to mirror
            log.debug("skipped a message on %s: %s", self.index.channel, e)

    def apply(self, announcement: bytes | str) -> None:
        """One change as `PrefixIndex.publish` or `remove` announced it."""
        change = json.loads(announcement)
        member, hashes = change["member"], change["hashes"].split()
        if change["op"] == "+":
            expiry = float(change["expiry"])
            for h in hashes:
                self._held.setdefault(int(h, 16), {})[member] = expiry
        else:
            for h in hashes:
                block_hash = int(h, 16)
                holders = self._held.get(block_hash)
                if holders is not None:
                    holders.pop(member, None)
                    if not holders:
                        del self._held[block_hash]

    def purge(self) -> None:
        """Drop lapsed members, and blocks nobody holds any more."""
        now = time.time()
        for block_hash in list(self._held):
            holders = {i: expiry for i, expiry in self._held[block_hash].items() if expiry > now}
            if holders:
                self._held[block_hash] = holders
            else:
                del self._held[block_hash]

    @property
    def num_blocks(self) -> int:
        return len(self._held)


def _text(member: bytes | str) -> str:
    return member.decode() if isinstance(member, bytes) else member
