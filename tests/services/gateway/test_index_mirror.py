"""The router's in-process copy of the prefix index, against a real redis-server: it
answers as `PrefixIndex.match` does, follows publishes and removals, lets entries lapse,
starts from what Redis already holds, survives a Redis restart, and answers while
Redis does not (the point: no round trip on a request's path).

Each test drives its own event loop with asyncio.run."""
from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager

from services.common.redis_client import connect_redis
from services.gateway.index_mirror import IndexMirror
from services.kvstore.prefix_index import PrefixIndex

H = [0x2000 + i for i in range(6)]  # stand-ins for a prompt's chained block hashes
WHO = ["a", "b", "c", "nobody"]


@asynccontextmanager
async def mirrored(url: str, model_key: str, **index_args):
    """An index on its own client (as workers publish) and a mirror of it, following it meanwhile."""
    publisher, follower = connect_redis(url), connect_redis(url)  # as the gateway and workers connect
    index = PrefixIndex(publisher, model_key, **index_args)
    mirror = IndexMirror(follower, PrefixIndex(follower, model_key, **index_args), retry_s=0.1)
    task = asyncio.ensure_future(mirror.run())
    try:
        yield index, mirror
    finally:
        mirror.is_stopping = True  # as PrefixRouter.close stops it
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await follower.aclose()
        await publisher.aclose()


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
        earlier = PrefixIndex(connect_redis(redis_server.url), "mirror-a")
        await earlier.publish("a", H[:4])  # before the mirror starts: it reads these from Redis
        await earlier.redis.aclose()
        async with mirrored(redis_server.url, "mirror-a") as (index, mirror):
            other_model = PrefixIndex(index.redis, "mirror-a-other")
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

    asyncio.run(main())


def test_entries_lapse_at_their_expiry_and_purging_forgets_them(redis_client, redis_server):
    async def main():
        async with mirrored(redis_server.url, "mirror-ttl", ttl_s=0.5) as (index, mirror):
            await until(lambda: mirror.is_synced)
            await index.publish("a", H)
            assert await until(lambda: mirror.match(H, ["a"]) == {"a": 6})
            await asyncio.sleep(0.6)
            assert mirror.match(H, ["a"]) == {"a": 0}  # as Redis's match: no longer held
            mirror.purge()
            assert mirror.num_blocks == 0

    asyncio.run(main())


def test_after_a_redis_restart_the_mirror_reads_the_index_again(redis_client, redis_server):
    async def main():
        async with mirrored(redis_server.url, "mirror-restart") as (index, mirror):
            await index.publish("a", H)
            assert await agrees(mirror, index)
            redis_server.stop()  # the index is gone with it (no persistence)
            assert await until(lambda: not mirror.is_synced)
            redis_server.start()
            await index.publish("b", H[:2])  # republished, as workers do once Redis is back
            assert await agrees(mirror, index)
            assert mirror.match(H, ["a", "b"]) == {"a": 0, "b": 2}

    asyncio.run(main())


def test_the_mirror_answers_while_redis_does_not(redis_client, redis_server):
    async def main():
        async with mirrored(redis_server.url, "mirror-paused") as (index, mirror):
            await index.publish("a", H[:3])
            assert await agrees(mirror, index)
            redis_client.execute_command("CLIENT", "PAUSE", 1500, "ALL")
            try:
                start = time.monotonic()
                assert mirror.match(H, ["a"]) == {"a": 3}
                assert time.monotonic() - start < 0.1
                assert mirror.is_synced
            finally:
                redis_client.execute_command("CLIENT", "UNPAUSE")

    asyncio.run(main())


def test_a_reconnection_the_client_makes_by_itself_is_followed_by_a_fresh_read(redis_client, redis_server):
    async def main():
        async with mirrored(redis_server.url, "mirror-reconnect") as (index, mirror):
            await index.publish("a", H)
            assert await agrees(mirror, index)
            # One transaction: the mirror's subscription is dropped, then "a" leaves the index and
            # the announcement reaches nobody. redis-py reconnects and subscribes again by itself.
            transaction = redis_client.pipeline(transaction=True)
            transaction.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            for h in H:
                transaction.zrem(index.key(h), "a")
            transaction.execute()
            assert await until(lambda: mirror.match(H, ["a"]) == {"a": 0})

    asyncio.run(main())
