"""The one way a Baton process connects to Redis (the prefix index and instance registry)."""
from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect_redis(url: str, timeout_s: float = 1.0) -> Redis:
    """A client that fails fast: a worker must not stall on an unreachable Redis (its next
    interval retries anyway). One immediate retry, because a pooled connection that a Redis
    restart closed fails once before it reconnects. Connects lazily, on the first command."""
    return Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                          retry=Retry(NoBackoff(), 1))
