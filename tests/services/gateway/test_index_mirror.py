"""The router's in-process copy of the prefix index, against a real redis-server: it
answers as `PrefixIndex.match` does, follows publishes and removals, lets entries lapse,
starts from what Redis already holds, survives a Redis restart, and answers while
Redis does not (the point: no round trip on a request's path).

Each test drives its own event loop with asyncio.run."""
from __future__ import annotations

import asyncio
import time

import redis.asyncio

from services.common.redis_client import connect_redis
from services.gateway.index_mirror import IndexMirror
from services.kvstore.prefix_index import PrefixIndex

H = [0x2000 + i for i in range(6)]  # stand-ins for a prompt's chained block hashes
WHO = ["a", "b", "c", "nobody"]


def client(url: str) -> redis.asyncio.Redis:
    return connect_redis(url)  # as the gateway and workers connect (one retry after a restart)


async def until(check, timeout_s: float = 5.0, poll_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            return value
        await asyncio.sleep(poll_s)


async def agrees(mirror: IndexMirror, index: PrefixIndex, hashes=H, who=WHO) -> bool:
    expected = await index.match(hashes, who)
    return await until(lambda: mirror.is_synced and mirror.match(hashes, who) == expected)


def test_the_mirror_starts_from_redis_and_follows_publishes_and_removals(redis_client, redis_server):
    async def main():
        r = client(redis_server.url)
        index, other_model = PrefixIndex(r, "mirror-a"), PrefixIndex(r, "mirror-a-other")
        await index.publish("a", H[:4])  # before the mirror starts: it reads these from Redis
        mirror = IndexMirror(client(redis_server.url), index)
        task = asyncio.ensure_future(mirror.run())
        try:
            assert await agrees(mirror, index)
            assert mirror.match(H, WHO) == {"a": 4, "b": 0, "c": 0, "nobody": 0}
            await index.publish("b", [H[0], H[2]])  # lacks H[1]: only its first block counts
            await index.publish("c", H)
            await other_model.publish("nobody", H)  # another model's index is not this one
            assert await agrees(mirror, index)
            assert mirror.match(H, WHO) == {"a": 4, "b": 1, "c": 6, "nobody": 0}
            await index.remove("c", [H[3]])
            await index.remove("a", H[:4])
            assert await agrees(mirror, index)
            assert mirror.match(H, WHO) == {"a": 0, "b": 1, "c": 3, "nobody": 0}
            assert mirror.match([], WHO) == dict.fromkeys(WHO, 0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.redis.aclose()
            await r.aclose()

    asyncio.run(main())


def test_entries_lapse_at_their_expiry_and_purging_forgets_them(redis_client, redis_server):
    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, "mirror-ttl", ttl_s=0.5)
        mirror = IndexMirror(client(redis_server.url), index)
        task = asyncio.ensure_future(mirror.run())
        try:
            await until(lambda: mirror.is_synced)
            await index.publish("a", H)
            assert await until(lambda: mirror.match(H, ["a"]) == {"a": 6})
            await asyncio.sleep(0.6)
            assert mirror.match(H, ["a"]) == {"a": 0}  # as Redis's match: no longer held
            mirror.purge()
            assert mirror.num_blocks == 0
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.redis.aclose()
            await r.aclose()

    asyncio.run(main())


def test_after_a_redis_restart_the_mirror_reads_the_index_again(redis_client, redis_server):
    async def main():
        index_client = client(redis_server.url)
        index = PrefixIndex(index_client, "mirror-restart")
        mirror = IndexMirror(client(redis_server.url), index, retry_s=0.1)
        task = asyncio.ensure_future(mirror.run())
        try:
            await index.publish("a", H)
            assert await agrees(mirror, index)
            redis_server.stop()  # the index is gone with it (no persistence)
            assert await until(lambda: not mirror.is_synced)
            redis_server.start()
            await index.publish("b", H[:2])  # republished, as workers do once Redis is back
            assert await agrees(mirror, index)
            assert mirror.match(H, ["a", "b"]) == {"a": 0, "b": 2}
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.redis.aclose()
            await index_client.aclose()

    asyncio.run(main())


def test_the_mirror_answers_while_redis_does_not(redis_client, redis_server):
    async def main():
        r = client(redis_server.url)
        index = PrefixIndex(r, "mirror-paused")
        mirror = IndexMirror(client(redis_server.url), index)
        task = asyncio.ensure_future(mirror.run())
        try:
            await index.publish("a", H[:3])
            assert await agrees(mirror, index)
            redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            start = time.monotonic()
            assert mirror.match(H, ["a"]) == {"a": 3}
            assert time.monotonic() - start < 0.1
            assert mirror.is_synced
        finally:
            redis_client.execute_command("CLIENT", "UNPAUSE")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await mirror.redis.aclose()
            await r.aclose()

    asyncio.run(main())
