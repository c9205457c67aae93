"""`KVBlockResidency`: how long a prefix-cache block stays, sampled, as vLLM's --kv-cache-metrics
measures it: for an operator sizing the KV pool (or a host tier under it) by how long prefixes
live, how long they sit unused before they go, and how far apart their reuses are.

A sampled block is followed from when it is cached (its KV computed or handed in) through each
prefix hit on it to its eviction (its page reused for other content), when three histograms count
it: its lifetime (cached to evicted), its idle time before eviction (last use, or its caching, to
evicted), and the gaps between its last few uses, its caching counting as the first. A block
forgotten otherwise (a prefix-cache reset, an adapter unloaded) is not counted: nothing pressed it
out. Only evictions are seen, so a block that stays is not counted until it goes."""
from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable

from engine.bucket_counts import BucketCounts

# Seconds, from a millisecond to an hour.
BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200,
          1800, 3600)
NUM_GAPS_KEPT = 4  # a block's last uses that gaps are counted between, as vLLM keeps them


class KVBlockResidency:
    """`sample_rate`: the fraction of cached blocks followed, in (0, 1]."""

    def __init__(self, sample_rate: float, clock: Callable[[], float] = time.monotonic,
                 draw: Callable[[], float] = random.random) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"the KV block sample rate must be in (0, 1], got {sample_rate}")
        self.sample_rate = sample_rate
        self.lifetime = BucketCounts(BOUNDS)
        self.idle_before_evict = BucketCounts(BOUNDS)
        self.reuse_gap = BucketCounts(BOUNDS)
        self._clock = clock
        self._draw = draw
        self._uses: dict[int, tuple[float, deque[float]]] = {}  # block id -> (cached at, last uses)

    def cached(self, block_id: int) -> None:
        if self._draw() < self.sample_rate:
            now = self._clock()
            self._uses[block_id] = (now, deque([now], maxlen=NUM_GAPS_KEPT + 1))

    def used(self, block_id: int) -> None:
        followed = self._uses.get(block_id)
        if followed is not None:
            followed[1].append(self._clock())

    def evicted(self, block_id: int) -> None:
        followed = self._uses.pop(block_id, None)
        if followed is None:
            return
        now = self._clock()
        cached_at, uses = followed
        self.lifetime.observe(now - cached_at)
        self.idle_before_evict.observe(now - uses[-1])
        for earlier, later in zip(uses, list(uses)[1:]):
            self.reuse_gap.observe(later - earlier)

    def forgotten(self, block_id: int) -> None:
        self._uses.pop(block_id, None)
