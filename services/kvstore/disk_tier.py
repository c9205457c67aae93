"""A disk tier under a kvstore node's host tier: the blocks host memory lets go of are written to
local disk (one file per block) instead of being forgotten, bounded in bytes, least recently used
deleted first; a block read from it goes back to host memory and leaves the disk (the two tiers
hold a block at most once between them). As LMCache's and SGLang's HiCache file backends spill a
CPU tier to disk: a prefix longer-lived than host memory allows is read back, not recomputed.

Files are written and deleted on a thread of the tier's own, in order, so that an eviction does not
stall the node's event loop for the disk; a block taken back is read by the caller off the loop too
(`DiskRead.load`), or, while its write is still queued, is the pages it was given. Every write has
a file name of its own, so a block written again while its earlier file is being read never shares
it. A write that fails (a full disk) loses its block; `take_lost` says which, for the index.

Its pages files (`*.kv`) in the directory when the node starts are left over from an earlier run,
which no index remembers, and are deleted; nothing else there is touched."""
from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import torch

from services.kvstore.layout import PageLayout

Key = tuple[bytes, int]  # (model fingerprint, block hash)


class DiskRead(NamedTuple):
    """A block taken from the tier, to load where blocking on the disk is harmless."""
    layout: PageLayout
    pages: torch.Tensor | None  # at hand: its write was still queued
    path: Path
    shape: tuple[int, ...]

    def load(self) -> torch.Tensor | None:
        """The block's pages, its file deleted; None when the file is gone or not whole."""
        if self.pages is not None:
            return self.pages
        pages = torch.empty(self.shape, dtype=torch.uint8)
        try:
            with open(self.path, "rb") as f:
                whole = f.readinto(pages.numpy().reshape(-1)) == pages.numel() and not f.read(1)
            self.path.unlink()
        except OSError:
            return None
        return pages if whole else None


class _OnDisk(NamedTuple):
    layout: PageLayout
    shape: tuple[int, ...]
    path: Path
    size: int


class _Write(NamedTuple):
    done: concurrent.futures.Future
    pages: torch.Tensor  # kept until the file holds them


class DiskPageTier:
    """Not thread-safe: the node's event loop owns it (as the host tier it serves); only the file
    writes and deletions run on its writer thread."""

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
        self._writes: dict[Key, _Write] = {}  # not yet known to be on disk
        self._lost: list[Key] = []  # their write failed
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-disk")
        self._num_files = 0  # written so far: each file's name is new

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
        self._settle()
        size = pages.numel()
        if size > self.capacity_bytes:
            return [key]
        self.discard(key)
        deleted = []
        while self.num_bytes + size > self.capacity_bytes:
            oldest = next(iter(self._blocks))
            self.discard(oldest)
            deleted.append(oldest)
        self._num_files += 1
        path = self.directory / f"{key[0].hex()}-{key[1] & 0xFFFF_FFFF_FFFF_FFFF:016x}-{self._num_files}.kv"
        pages = pages.contiguous()
        self._writes[key] = _Write(self._writer.submit(_write, pages, path), pages)
        self._blocks[key] = _OnDisk(layout, tuple(pages.shape), path, size)
        self.num_bytes += size
        return deleted

    def take(self, key: Key) -> DiskRead | None:
        """A block, out of the tier (its file goes when it is loaded); None when it is not here."""
        self._settle()
        found = self._blocks.pop(key, None)
        if found is None:
            return None
        self.num_bytes -= found.size
        writing = self._writes.pop(key, None)
        if writing is None:
            return DiskRead(found.layout, None, found.path, found.shape)
        self._writer.submit(found.path.unlink, missing_ok=True)  # after its write, which is queued first
        return DiskRead(found.layout, writing.pages, found.path, found.shape)

    def discard(self, key: Key) -> bool:
        found = self._blocks.pop(key, None)
        if found is None:
            return False
        self.num_bytes -= found.size
        self._writes.pop(key, None)
        self._writer.submit(found.path.unlink, missing_ok=True)
        return True

    def clear(self) -> int:
        forgotten = len(self._blocks)
        for key in list(self._blocks):
            self.discard(key)
        return forgotten

    def take_lost(self) -> list[Key]:
        """The blocks whose write failed since the last call (they are not held any more)."""
        self._settle()
        lost, self._lost = self._lost, []
        return lost

    def flush(self) -> None:
        """Wait for every write and deletion queued so far."""
        self._writer.submit(lambda: None).result()
        self._settle()

    def close(self) -> None:
        """Delete every file, once the writes queued are done."""
        self.clear()
        self._writer.shutdown(wait=True)

    def _settle(self) -> None:
        """Let go of the pages of finished writes; a failed one's block is lost."""
        for key, writing in list(self._writes.items()):
            if not writing.done.done():
                continue
            del self._writes[key]
            if writing.done.exception() is not None:
                self.num_bytes -= self._blocks.pop(key).size
                self._lost.append(key)


def _write(pages: torch.Tensor, path: Path) -> None:
    pages.numpy().tofile(path)
