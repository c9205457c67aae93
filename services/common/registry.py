"""`InstanceRegistry`: which workers are alive, where they listen and how loaded they are.

Each worker heartbeats its `InstanceInfo` every TTL/3; one that stops (crash,
SIGKILL, partition) drops out of `instances` one TTL after its last heartbeat.

Layout, one hash per kind:

    baton:inst:{kind}   field: instance id   value: InstanceInfo as JSON, with `expires_at`

Why a hash and not a key per instance with its own EX: listing a kind is then one
HGETALL (one round trip, no SCAN over the keyspace), and Redis 7.0 has no per-field
expiry, so each value carries its own `expires_at` (the heartbeating client's clock,
hosts NTP-synchronized) and readers skip lapsed ones. `instances` deletes the lapsed
fields it finds (a second round trip only then), and the whole hash expires one TTL
after the last heartbeat of its kind, so nothing lingers.
"""
from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Literal

from redis.asyncio import Redis

Kind = Literal["prefill", "decode", "kvstore"]
KEY_PREFIX = "baton"  # as services/kvstore/prefix_index.py: one namespace for Baton in a shared Redis


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """One worker as the router sees it. Load figures are a snapshot from its last heartbeat."""

    instance_id: str
    kind: Kind
    address: str  # host:port of its gRPC server
    model_key: str  # hex model fingerprint; "" for a kvstore node that serves any model
    block_size: int
    queued_tokens: int = 0  # prompt tokens admitted but not yet computed
    free_pages: int = 0  # KV pages nobody references (cached ones included: evictable)
    total_pages: int = 0
    running: int = 0
    waiting: int = 0

    def to_json(self, expires_at: float) -> str:
        return json.dumps({**dataclasses.asdict(self), "expires_at": expires_at}, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> tuple[InstanceInfo, float]:
        """The info and its `expires_at`; unknown fields (a newer writer) are ignored."""
        fields = json.loads(text)
        expires_at = float(fields.pop("expires_at", 0.0))
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known}), expires_at


class InstanceRegistry:
    def __init__(self, redis: Redis, ttl_s: float = 3.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.redis = redis
        self.ttl_s = ttl_s

    @staticmethod
    def key(kind: str) -> str:
        return f"{KEY_PREFIX}:inst:{kind}"

    async def heartbeat(self, info: InstanceInfo) -> bool:
        """Record `info` as alive until one TTL from now (one round trip). True when Redis did not
        know this instance: its first heartbeat, or Redis lost its data (restart, flush) or
        dropped it (silent past its TTL), and what the instance published may be gone too."""
        now = time.time()
        key = self.key(info.kind)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, info.instance_id, info.to_json(now + self.ttl_s))
        pipe.pexpire(key, max(1, int(self.ttl_s * 1000)))
        num_new, _ = await pipe.execute()
        return num_new == 1

    async def instances(self, kind: str) -> list[InstanceInfo]:
        """The live instances of `kind` (heartbeat within one TTL), sorted by id."""
        key = self.key(kind)
        entries = await self.redis.hgetall(key)
        now = time.time()
        live, lapsed = [], []
        for field, value in entries.items():
            info, expires_at = InstanceInfo.from_json(value)
            if expires_at > now:
                live.append(info)
            else:
                lapsed.append(field)
        if lapsed:
            # A worker that heartbeats again in between is back on its next heartbeat.
            await self.redis.hdel(key, *lapsed)
        return sorted(live, key=lambda info: info.instance_id)

    async def remove(self, kind: str, instance_id: str) -> None:
        """Drop an instance at once (clean shutdown), without waiting for its TTL."""
        await self.redis.hdel(self.key(kind), instance_id)
