"""A disk tier under a kvstore node's host tier: the blocks host memory lets go of are written to
local disk (one file per block) instead of being forgotten, bounded in bytes, least recently used
deleted first; a block read from it goes back to host memory and leaves the disk (the two tiers
hold a block at most once between them). As LMCache's and SGLang's HiCache file backends spill a
CPU tier to disk: a prefix longer-lived than host memory allows is read back, not recomputed.

Its pages files (`*.kv`) in the directory when the node starts are left over from an earlier run,
which no index remembers, and are deleted; nothing else there is touched."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from services.kvstore.layout import PageLayout

Key = tuple[bytes, int]  # (model fingerprint, block hash)


class _OnDisk(NamedTuple):
    layout: PageLayout
    shape: tuple[int, ...]
    path: Path


class DiskPageTier:
    """Not thread-safe: the node's event loop owns it (as the host tier it serves)."""

    def __init__(self, directory: Path, capacity_bytes: int) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob("*.kv"):
            stale.unlink()
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._blocks: OrderedDict[Key, _OnDisk] = OrderedDict()  # least recently used first

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: Key) -> bool:
        return key in self._blocks

    def keys(self) -> list[Key]:
        return list(self._blocks)

    def put(self, key: Key, layout: PageLayout, pages: torch.Tensor) -> list[Key]:
        """Write a block (uint8 pages) as the most recently used; the keys deleted to make room (with
        `key` itself when the block is larger than the whole tier: it is not kept)."""
        size = pages.numel()
        if size > self.capacity_bytes:
            return [key]
        self.discard(key)
        deleted = []
        while self.num_bytes + size > self.capacity_bytes:
            deleted.append(self._delete_oldest())
        path = self.directory / f"{key[0].hex()}-{key[1] & 0xFFFF_FFFF_FFFF_FFFF:016x}.kv"
        pages.contiguous().numpy().tofile(path)
        self._blocks[key] = _OnDisk(layout, tuple(pages.shape), path)
        self.num_bytes += size
        return deleted

    def take(self, key: Key) -> tuple[PageLayout, torch.Tensor] | None:
        """A block's layout and pages, read and deleted from disk; None when it is not here."""
        found = self._blocks.pop(key, None)
        if found is None:
            return None
        pages = torch.from_numpy(np.fromfile(found.path, dtype=np.uint8).reshape(found.shape))
        found.path.unlink()
        self.num_bytes -= pages.numel()
        return found.layout, pages

    def discard(self, key: Key) -> bool:
        found = self._blocks.pop(key, None)
        if found is None:
            return False
        self.num_bytes -= found.path.stat().st_size
        found.path.unlink()
        return True

    def clear(self) -> int:
        forgotten = len(self._blocks)
        for found in self._blocks.values():
            found.path.unlink()
        self._blocks.clear()
        self.num_bytes = 0
        return forgotten

    def _delete_oldest(self) -> Key:
        key, found = self._blocks.popitem(last=False)
        self.num_bytes -= found.path.stat().st_size
        found.path.unlink()
        return key
