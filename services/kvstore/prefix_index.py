"""`PrefixIndex`: which instances hold which KV blocks, in Redis, for prefix-aware routing.

A block hash (engine/block_hash.py) names its whole prefix, so the set of hashes an
instance holds is a radix tree of the prompts it can serve from cache; asking how
many leading hashes of a prompt's chain an instance holds is a longest-prefix match.

Layout, one sorted set per block hash per model:

    baton:{model_key}:blk:{hash:016x}   member: instance id   score: expiry (unix seconds)

- A member counts only while its score is in the future: a worker refreshes what it
  holds (`publish`) well within the TTL and removes what it evicts (`remove`); one
  that stops (SIGKILL) leaves entries that lapse at most one TTL after its last
  refresh. A lapsed member is only skipped by `match`; it is deleted by the next
  `publish` of that block, or with the whole key.
- Every `publish` also sets the key's own expiry to one TTL, so a key nobody
  refreshes disappears with all its members (Redis frees it; no sweeper needed).
  Publishers of one model should share a TTL: a shorter one may expire a key early,
  which only costs a recomputation until the next refresh.
- Scores use the client's clock (hosts are assumed NTP-synchronized; skew well below
  the TTL only shifts expiry by the skew). The key's expiry uses Redis's clock.
- `model_key` (the hex model fingerprint) is in every key, so two models never share
  an entry even when their token ids and block size agree.

Every `publish` and `remove` also announces itself on the model's channel,
`baton:{model_key}:index`, in the same script (so a change and its announcement cannot
part): JSON `{"op": "+", "member", "expiry", "hashes"}` or `{"op": "-", "member", "hashes"}`,
`hashes` in hex, separated by spaces.
A router keeps its own copy of the index from it (services/gateway/index_mirror.py) and
matches prompts without a round trip.

`match` is one round trip whatever the number of blocks: a script that walks the
prompt's chain on the server and stops at the first block nobody asked about holds.
(A pipeline of one ZMSCORE per block cost the router ~2 ms of client CPU for a
1,000-token prompt, on every request's path.) `publish` and `remove` run a server-side script per chunk of
`CHUNK` blocks: a worker refreshes every block it holds every TTL/3, and one command
per chunk costs its event loop several times less than three commands per block
(20k blocks: ~60 ms of client CPU). The scripts touch many keys at once, so this
assumes a standalone Redis (or a replicated one), not Redis Cluster.

A stale entry is harmless: a worker that no longer holds a promised block recomputes it.
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence

from redis.asyncio import Redis

KEY_PREFIX = "baton"
# Blocks per script call: a script blocks the Redis server while it runs (~10 µs per block),
# so chunks keep a refresh of many blocks from delaying routers' lookups by more than ~10 ms.
CHUNK = 1024

# KEYS: the block keys. ARGV: member, expiry score, now, key TTL in ms, channel, announcement.
_PUBLISH = """
for _, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[3])
  redis.call('ZADD', key, ARGV[2], ARGV[1])
  redis.call('PEXPIRE', key, ARGV[4])
end
redis.call('PUBLISH', ARGV[5], ARGV[6])
"""
# KEYS: the prompt's block keys, in order. ARGV: now, then the members asked about.
# Returns, per member, how many leading blocks it holds unexpired.
_MATCH = """
local now = tonumber(ARGV[1])
local n = #ARGV - 1
local counts, alive = {}, {}
for j = 1, n do counts[j] = 0; alive[j] = true end
local remaining = n
for i, key in ipairs(KEYS) do
  local scores = redis.call('ZMSCORE', key, unpack(ARGV, 2))
  for j = 1, n do
    if alive[j] then
      local score = scores[j]
      if score and tonumber(score) > now then
        counts[j] = i
      else
        alive[j] = false
        remaining = remaining - 1
      end
    end
  end
  if remaining == 0 then break end
end
return counts
"""
# KEYS: the block keys. ARGV: member, channel, announcement.
_REMOVE = """
for _, key in ipairs(KEYS) do
  redis.call('ZREM', key, ARGV[1])
end
redis.call('PUBLISH', ARGV[2], ARGV[3])
"""


class PrefixIndex:
    def __init__(self, redis: Redis, model_key: str, ttl_s: float = 30.0) -> None:
        if not model_key:
            raise ValueError("model_key must not be empty")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.redis = redis
        self.model_key = model_key
        self.key_prefix = f"{KEY_PREFIX}:{model_key}:blk:"  # + the block hash in hex
        self.channel = f"{KEY_PREFIX}:{model_key}:index"  # where publish and remove announce themselves
        self.ttl_s = ttl_s
        self._publish = redis.register_script(_PUBLISH)
        self._remove = redis.register_script(_REMOVE)
        self._match = redis.register_script(_MATCH)

    def key(self, block_hash: int) -> str:
        return f"{self.key_prefix}{block_hash:016x}"

    async def publish(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        """Record (or refresh) that `instance_id` holds these blocks, until one TTL from now.
        Lapsed members of other instances are deleted on the way, so sets stay small."""
        hashes = [f"{h:016x}" for h in block_hashes]
        now = time.time()
        expiry = now + self.ttl_s
        args = [instance_id, repr(expiry), repr(now), max(1, int(self.ttl_s * 1000)), self.channel]
        for start in range(0, len(hashes), CHUNK):
            chunk = hashes[start : start + CHUNK]
            await self._publish(keys=[self.key_prefix + h for h in chunk],
                                args=[*args, json.dumps({"op": "+", "member": instance_id, "expiry": expiry,
                                                         "hashes": " ".join(chunk)})])

    async def remove(self, instance_id: str, block_hashes: Iterable[int]) -> None:
        """Forget that `instance_id` holds these blocks (it evicted them, or is shutting down)."""
        hashes = [f"{h:016x}" for h in block_hashes]
        for start in range(0, len(hashes), CHUNK):
            chunk = hashes[start : start + CHUNK]
            await self._remove(keys=[self.key_prefix + h for h in chunk],
                               args=[instance_id, self.channel,
                                     json.dumps({"op": "-", "member": instance_id, "hashes": " ".join(chunk)})])

    async def match(self, block_hashes: Sequence[int], instance_ids: Sequence[str]) -> dict[str, int]:
        """For each of `instance_ids`: how many leading blocks of `block_hashes` (a prompt's
        chain, in order) it holds now. A block it lacks ends its count, even if it holds
        later ones (their KV is useless without the prefix)."""
        counts = dict.fromkeys(instance_ids, 0)
        if not block_hashes or not counts:
            return counts
        ids = list(counts)
        held = await self._match(keys=[self.key(h) for h in block_hashes], args=[repr(time.time()), *ids])
        return dict(zip(ids, (int(n) for n in held)))
