"""How a worker's KV pool is sized: --kv-blocks pages, or vLLM's --kv-cache-memory-bytes, a size
in bytes that holds as many pages as fit for the model's layout and KV dtype (a draft model's pages
beside them), which operators plan memory by, or on a GPU vLLM's --gpu-memory-utilization (the
worker's share of the device's memory, its weights and pool together: engine/kv_pool.py), or
--kv-memory-fraction, the share of the memory free once the weights are loaded (the host's on a CPU,
the device's on a GPU: several workers on one GPU split it so). The bytes win over the share of the
device, it over the fraction, the fraction over the pages, as vLLM's size wins over its other
sizing; `baton up` passes --kv-blocks to colocated workers, which a size or a fraction in
--decode-args then replaces, and splits its own --gpu-memory-utilization between the workers on a GPU.

Sizes are read as vLLM reads them: a plain integer, or one with a suffix, lowercase decimal
(k, m, g, t: 25.6k is 25,600) or uppercase binary (K, M, G, T: 16G is 16 x 2^30, whole numbers only).
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

from services.common.settings import ConfigError

DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
SIZE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def byte_count(text: str) -> int:
    match = SIZE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4294967296, 4G or 4.3g)")
    number, suffix = match.groups()
    if suffix in DECIMAL:
        return int(float(number) * DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a fraction goes with a decimal suffix (k, m, g, t) only")
    return int(number) * BINARY.get(suffix, 1)


MAX_MEMORY_FRACTION = 0.95  # engine/config.py's bound: the rest is the step's own working memory


def add_kv_memory_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str,
                       fraction_env_var: str, utilization_env_var: str) -> None:
    given = env.get(env_var) or None
    parser.add_argument("--kv-cache-memory-bytes", type=byte_count, default=given, metavar="SIZE",
                        help=f"KV pool size in bytes, e.g. 8G (as vLLM's flag; replaces --kv-blocks) (${env_var})")
    fraction = env.get(fraction_env_var) or None
    parser.add_argument("--kv-memory-fraction", type=float, default=None if fraction is None else float(fraction),
                        metavar="F",
                        help=f"KV pool size as this share of the memory free once the weights are loaded (the "
                             f"host's on a CPU, the device's on a GPU), in (0, {MAX_MEMORY_FRACTION}]; replaces "
                             f"--kv-blocks, --kv-cache-memory-bytes replaces it (${fraction_env_var})")
    utilization = env.get(utilization_env_var) or None
    parser.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, metavar="F",
                        default=None if utilization is None else float(utilization),
                        help=f"on a GPU, this worker's share of the device's memory, in (0, 1], for its weights "
                             f"and KV pool, a step's activations in the rest (vLLM's flag, sized as SGLang's "
                             f"--mem-fraction-static, taken too); workers sharing a GPU split it; ignored on the "
                             f"CPU, as vLLM's CPU backend ignores it; --kv-cache-memory-bytes replaces it, it "
                             f"replaces --kv-memory-fraction and --kv-blocks (${utilization_env_var})")


DEFAULT_STATE_CACHE_BYTES, DEFAULT_STATE_SNAPSHOT_INTERVAL = 2 * 2**30, 512  # engine/config.py's


def add_state_cache_flags(parser: argparse.ArgumentParser) -> None:
    """A hybrid model's (Qwen3.5's, Qwen3-Next's) recurrent states kept for its prefix cache
    (engine/state_snapshots.py)."""
    parser.add_argument("--state-cache-bytes", type=byte_count, default=DEFAULT_STATE_CACHE_BYTES, metavar="SIZE",
                        help="a hybrid model's recurrent states kept at the ends of cached prefixes, in host memory: "
                             "at most SIZE (default 2G; 0: none kept, so no prefix is continued from)")
    parser.add_argument("--state-snapshot-interval", type=int, default=DEFAULT_STATE_SNAPSHOT_INTERVAL, metavar="N",
                        help="... kept also every N tokens inside a prompt's chunk (rounded up to whole pages; "
                             f"default {DEFAULT_STATE_SNAPSHOT_INTERVAL}), beside each chunk's end and a request's "
                             "last page end")


def check_state_cache(num_bytes: int, interval: int) -> None:
    if num_bytes < 0:
        raise ConfigError(f"--state-cache-bytes must be 0 or more, got {num_bytes}")
    if interval < 1:
        raise ConfigError(f"--state-snapshot-interval must be at least 1, got {interval}")


def pool_size_options(config) -> dict:
    """A worker config's pool size as EngineConfig takes it (which reads bytes first, then a GPU's share,
    then pages, then the fraction): its pages left out where a fraction is given."""
    fraction = config.kv_memory_fraction
    return {"kv_cache_memory_bytes": config.kv_cache_memory_bytes,
            "gpu_memory_utilization": config.gpu_memory_utilization,
            "num_kv_blocks": None if fraction is not None else config.num_kv_blocks,
            **({"kv_memory_fraction": fraction} if fraction is not None else {})}


def check_memory_shares(fraction: float | None, utilization: float | None) -> None:
    """--kv-memory-fraction and --gpu-memory-utilization, each where given."""
    if fraction is not None and not 0 < fraction <= MAX_MEMORY_FRACTION:
        raise ConfigError(f"--kv-memory-fraction must be in (0, {MAX_MEMORY_FRACTION}], got {fraction}")
    if utilization is not None and not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
