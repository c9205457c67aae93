"""glibc malloc settings for a process that runs a model on the CPU.

PyTorch's CPU allocator caches nothing: each forward pass mallocs and frees all its
activations. By default glibc returns a freed chunk over its mmap threshold (128 KiB
until frees of larger mmapped chunks raise it) to the kernel, and trims the heap once
128 KiB at its top is free, so the next forward pass faults the same pages in again:
about 2,000 minor page faults per 512-token prefill of the demo model, several
milliseconds of a 35 ms forward pass in a VM (bench/host_memory.py measures it). Keeping
freed memory for reuse, as jemalloc and tcmalloc do (the CPU guides of vLLM and Intel
preload one of them), costs at most the process's peak working set, which a serving
process reaches on its first long prompt anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

# mallopt parameters, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc's ceiling for the mmap threshold on 64-bit hosts (DEFAULT_MMAP_THRESHOLD_MAX): chunks
# up to this size come from the heap and are reused; larger ones are still mapped per use.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free memory at the heap's top kept for the next pass instead of given back.
TRIM_THRESHOLD_BYTES = 1 << 30


def retain_freed_memory() -> bool:
    """Keep freed heap memory in this process for reuse; whether it applied (glibc only)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    # Setting either turns off glibc's dynamic threshold, so both are set.
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
