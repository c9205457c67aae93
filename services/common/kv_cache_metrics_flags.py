"""Workers' vLLM flags for KV block residency metrics: --kv-cache-metrics turns them on, and
--kv-cache-metrics-sample is the fraction of cached blocks followed (default 0.01, as vLLM's):
each sampled block's lifetime, idle time before eviction and reuse gaps, in `/metrics` as
`baton_kv_block_lifetime_seconds`, `..._idle_before_evict_seconds` and `..._reuse_gap_seconds`
(engine/kv_block_residency.py)."""
from __future__ import annotations

import argparse

from services.common.settings import ConfigError

DEFAULT_SAMPLE = 0.01


def add_kv_cache_metrics_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-cache-metrics", action="store_true",
                        help="measure how long prefix-cache blocks live, sit idle before eviction and wait between "
                             "reuses (vLLM's flag)")
    parser.add_argument("--kv-cache-metrics-sample", type=float, default=DEFAULT_SAMPLE, metavar="FRACTION",
                        help=f"the fraction of cached blocks measured with --kv-cache-metrics, in (0, 1] "
                             f"(default {DEFAULT_SAMPLE})")


def kv_cache_metrics_sample(args: argparse.Namespace) -> float:
    """The fraction of blocks followed: 0 without --kv-cache-metrics; ConfigError for one out of range."""
    if not 0 < args.kv_cache_metrics_sample <= 1:
        raise ConfigError(f"--kv-cache-metrics-sample must be in (0, 1], got {args.kv_cache_metrics_sample}")
    return args.kv_cache_metrics_sample if args.kv_cache_metrics else 0.0
