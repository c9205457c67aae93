"""The gateway's follower of the background responses' cancel channel (a real Redis pub/sub) ends
when closed, however soon after it started: redis-py's read of the channel can take a cancel that
comes as its own poll timeout runs out for that timeout and read on, which hung the gateway's
shutdown (seen where it stopped right after starting: its HTTP port taken)."""
from __future__ import annotations

import asyncio

from services.common.redis_client import connect_redis
from services.gateway.background_responses import BackgroundResponses
from services.gateway.response_store import RedisResponseStore


async def close_soon_after_following(url: str, delay_s: float) -> bool:
    """Whether closing `delay_s` after the following began ended within a second."""
    redis = connect_redis(url)
    try:
        background = BackgroundResponses()
        background.follow_cancels(RedisResponseStore(redis, ttl_s=60))
        await asyncio.sleep(delay_s)
        closing = asyncio.ensure_future(background.close())
        done, _ = await asyncio.wait([closing], timeout=1.0)
        if not done:
            closing.cancel()
        return bool(done)
    finally:
        await redis.aclose()


def test_the_cancel_follower_ends_however_soon_it_is_closed(redis_server):
    redis_server.start()

    async def each_delay() -> list[float]:
        # Across the subscription's first poll, where a cancel was lost about one time in two.
        delays = [i / 10_000 for i in range(30)]
        return [delay for delay in delays if not await close_soon_after_following(redis_server.url, delay)]

    assert asyncio.run(each_delay()) == []
