"""`IterationTokens`: how many tokens each engine step computes, counted in buckets as vLLM's
`iteration_tokens_total` histogram counts them (a prefill chunk's tokens and one per decoding
sequence, drafts included). The scheduler counts each batch it makes; a metrics collector reads the
counts when Prometheus scrapes, so a step pays one bisect."""
from __future__ import annotations

from bisect import bisect_left

# Upper bounds (inclusive), as vLLM's: one token, then the batch sizes steps are captured at.
BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class IterationTokens:
    def __init__(self) -> None:
        self.counts = [0] * (len(BOUNDS) + 1)  # per bucket (the last: over every bound), not cumulative
        self.num_tokens = 0  # over every step

    def observe(self, num_tokens: int) -> None:
        self.counts[bisect_left(BOUNDS, num_tokens)] += 1
        self.num_tokens += num_tokens

    def cumulative_buckets(self) -> list[tuple[float, int]]:
        """(upper bound, steps with at most that many tokens), as Prometheus' histogram buckets, ending
        with infinity (every step)."""
        counts, total = list(self.counts), 0
        buckets = []
        for bound, count in zip((*BOUNDS, float("inf")), counts):
            total += count
            buckets.append((float(bound), total))
        return buckets
