"""The shared-memory segment each decode worker keeps its KV pool in, and removing leftovers.

A decode worker unlinks its segment when it stops on SIGTERM, and its
multiprocessing resource tracker does when the worker alone is SIGKILLed; when
both are killed (`kill -9` of its process group, the OOM killer), the name stays
in /dev/shm until `baton up` removes it.
"""
from __future__ import annotations

import _posixshmem  # what multiprocessing.shared_memory creates and unlinks with
import re
from pathlib import Path

# A decode worker logs "serving DIR: N KV blocks in shared memory NAME" once SERVING (a GPU pool's: "...
# in cuda memory (CUDA IPC), their fence in shared memory NAME"); NAME starts with
# services/kvstore/shared_memory.py's NAME_PREFIX.
SEGMENT_LINE = re.compile(r"KV blocks in (?:.* )?shared memory (baton_kv_\w+)\s*$")
_MAPPED_SEGMENT = re.compile(r"\s/dev/shm/(baton_kv_\w+)(?: \(deleted\))?$")


def mapped_segments(pid: int) -> list[str]:
    """Baton KV segments process `pid` has mapped (Linux /proc; [] where unreadable)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({m[1] for line in maps.splitlines() if (m := _MAPPED_SEGMENT.search(line))})


def remove_segment(name: str) -> bool:
    """Unlink segment `name`; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True
