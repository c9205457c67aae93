"""How a worker's KV pool is sized: --kv-blocks pages, or vLLM's --kv-cache-memory-bytes, a size
in bytes that holds as many pages as fit for the model's layout and KV dtype (a draft model's pages
beside them), which operators plan memory by. Where both are given the bytes win, as vLLM's flag
wins over its other sizing; `baton up` passes --kv-blocks to colocated workers, which a size in
--decode-args then replaces.

Sizes are read as vLLM reads them: a plain integer, or one with a suffix, lowercase decimal
(k, m, g, t: 25.6k is 25,600) or uppercase binary (K, M, G, T: 16G is 16 x 2^30, whole numbers only).
"""
from __future__ import annotations

import argparse
import re
from collections.abc import Mapping

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


def add_kv_memory_flag(parser: argparse.ArgumentParser, env: Mapping[str, str], *, env_var: str) -> None:
    given = env.get(env_var) or None
    parser.add_argument("--kv-cache-memory-bytes", type=byte_count, default=given, metavar="SIZE",
                        help=f"KV pool size in bytes, e.g. 8G (as vLLM's flag; replaces --kv-blocks) (${env_var})")
