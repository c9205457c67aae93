"""`BucketCounts`: observations counted in buckets, as a Prometheus histogram counts them, kept by the
engine and read by a metrics collector when Prometheus scrapes: an observation pays one bisect and
the engine imports nothing of Prometheus."""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


class BucketCounts:
    """`bounds`: the buckets' upper bounds (inclusive), ascending."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (the last: over every bound), not cumulative
        self.total = 0  # the sum of every observation

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative_buckets(self) -> list[tuple[float, int]]:
        """(upper bound, observations at most that), as Prometheus' histogram buckets, ending with
        infinity (every observation)."""
        counts, total = list(self.counts), 0
        buckets = []
        for bound, count in zip((*self.bounds, float("inf")), counts):
            total += count
            buckets.append((float(bound), total))
        return buckets
