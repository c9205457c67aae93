"""How many tokens each engine step computes, counted in buckets as vLLM's `iteration_tokens_total`
histogram counts them (a prefill chunk's tokens and one per decoding sequence, drafts included):
the scheduler counts each batch it makes."""
from __future__ import annotations

from engine.bucket_counts import BucketCounts

# Upper bounds (inclusive), as vLLM's: one token, then the batch sizes steps are captured at.
BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def iteration_tokens() -> BucketCounts:
    return BucketCounts(BOUNDS)
