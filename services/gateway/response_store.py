"""The Responses API's stored responses: what `previous_response_id` continues, and what
`GET /v1/responses/{id}` (and its `input_items`) reads and `DELETE` removes.

A record is the response as it was returned and the conversation it answered: the input items
of the turns before it, then its own. A response that continues one is answered from that
record's conversation and output, so a chain of any length is one read. In Redis when the gateway
has one (`--redis`): every gateway replica behind a load balancer then continues what any other
stored. Otherwise in this process, the most recent MEMORY_CAPACITY only. Either way a record
expires `ttl_s` after it was stored, as OpenAI keeps responses for a while, not for ever.
"""
from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from services.gateway.errors import APIError

MEMORY_CAPACITY = 4096  # records kept in the process without Redis (a long conversation's is ~its text)
KEY_PREFIX = "baton:response:"
CANCEL_POLL_S = 0.5  # how long one read of the cancel channel waits, below the client's socket timeout
CANCEL_CHANNEL = "baton:response-cancels"  # ids of background responses to stop, whichever gateway runs them


@dataclass
class StoredResponse:
    response: dict[str, Any]  # as returned
    conversation: list[dict[str, Any]]  # the input items it answered: earlier turns', then its own

    def continued(self) -> list[dict[str, Any]]:
        """The input items a response continuing this one comes after: its conversation and its output."""
        return [*self.conversation, *self.response["output"]]


class MemoryResponseStore:
    """Records in this process: the most recent `capacity`, each for `ttl_s` seconds."""

    def __init__(self, ttl_s: float, capacity: int = MEMORY_CAPACITY) -> None:
        self.ttl_s = ttl_s
        self.capacity = capacity
        self._records: OrderedDict[str, tuple[float, StoredResponse]] = OrderedDict()

    async def put(self, record: StoredResponse) -> None:
        response_id = record.response["id"]
        self._records[response_id] = (time.monotonic() + self.ttl_s, record)
        self._records.move_to_end(response_id)
        while len(self._records) > self.capacity:
            self._records.popitem(last=False)

    async def get(self, response_id: str) -> StoredResponse | None:
        entry = self._records.get(response_id)
        if entry is None:
            return None
        if entry[0] < time.monotonic():
            del self._records[response_id]
            return None
        return entry[1]

    async def delete(self, response_id: str) -> bool:
        if await self.get(response_id) is None:
            return False
        del self._records[response_id]
        return True

    async def close(self) -> None:
        self._records.clear()

    async def ask_to_cancel(self, response_id: str) -> None:
        """Only this gateway generates what it stores: nothing to ask of others."""

    async def cancels(self) -> AsyncIterator[str]:
        return
        yield


class RedisResponseStore:
    """Records in Redis, one JSON string per response (`baton:response:{id}`), expiring after `ttl_s`.
    Redis down: a response is still answered, unstored (a warning says so); reading one is a 503."""

    def __init__(self, redis, ttl_s: float) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def put(self, record: StoredResponse) -> None:
        body = json.dumps({"response": record.response, "conversation": record.conversation},
                          separators=(",", ":"), ensure_ascii=False)
        await self.redis.set(KEY_PREFIX + record.response["id"], body, px=max(1, int(self.ttl_s * 1e3)))

    async def get(self, response_id: str) -> StoredResponse | None:
        try:
            body = await self.redis.get(KEY_PREFIX + response_id)
        except (RedisError, OSError) as e:
            raise unavailable(e) from e
        if body is None:
            return None
        fields = json.loads(body)
        return StoredResponse(fields["response"], fields["conversation"])

    async def delete(self, response_id: str) -> bool:
        try:
            return bool(await self.redis.delete(KEY_PREFIX + response_id))
        except (RedisError, OSError) as e:
            raise unavailable(e) from e

    async def ask_to_cancel(self, response_id: str) -> None:
        """Ask every gateway sharing this Redis to stop `response_id`, if it generates it."""
        try:
            await self.redis.publish(CANCEL_CHANNEL, response_id)
        except (RedisError, OSError) as e:
            raise unavailable(e) from e

    async def cancels(self) -> AsyncIterator[str]:
        """The ids asked to be cancelled (`ask_to_cancel`) from now on; ends if Redis goes away."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(CANCEL_CHANNEL)
            while True:
                # Polled: the client's socket timeout (connect_redis) would end a blocking read.
                message = await pubsub.get_message(timeout=CANCEL_POLL_S)
                if message is not None and message["type"] == "message":
                    yield message["data"].decode()
        finally:
            await pubsub.aclose()

    async def close(self) -> None:
        await self.redis.aclose()


def unavailable(e: Exception) -> APIError:
    return APIError(503, f"the response store (Redis) is unavailable: {type(e).__name__}: {e}")


def not_found(response_id: str, param: str | None = None) -> APIError:
    """OpenAI's answer to a response id it does not hold (never stored, expired or deleted)."""
    if param == "previous_response_id":
        return APIError(404, f"Previous response with id '{response_id}' not found.", param=param,
                        code="previous_response_not_found")
    return APIError(404, f"Response with id '{response_id}' not found.", code="response_not_found")
