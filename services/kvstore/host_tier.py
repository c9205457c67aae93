"""A host-memory tier of KV pages, named by block hash, bounded in bytes, LRU-evicted.

A block hash names its whole prefix (engine/block_hash.py chains each block onto its
parent and the model fingerprint), so the tier needs no tree: the longest stored
prefix of a list of hashes is read by walking it until the first miss. Keys carry
the model fingerprint too, so two models' pages never answer for each other; each
block keeps its layout, and a reader expecting another one is refused.

With a disk tier under it (disk_tier.py), a block it evicts is written there rather than
forgotten, and read back into host memory when a prefix walk reaches it: the node holds it
until the disk lets it go. The reads run on a thread, the prefix's blocks together, so that
other requests go on meanwhile; a walk that reaches a block already being read waits for that
read rather than missing it.

Like a worker's prefix cache (BlockManager), the tier records which blocks entered
and left the node (either tier) once `enable_events` is called, as net changes between
drains, for the node to publish to the prefix index.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import NamedTuple

import torch

from services.kvstore.disk_tier import DiskPageTier, DiskRead
from services.kvstore.layout import PageLayout


class StoredBlock(NamedTuple):
    layout: PageLayout   # num_blocks = 1
    pages: torch.Tensor  # uint8 [L, 2*Hkv, bs*D*itemsize]: one block, every layer


Key = tuple[bytes, int]  # (model fingerprint, block hash)


class HostPageTier:
    """Not thread-safe: the node's event loop owns it."""

    def __init__(self, capacity_bytes: int, disk: DiskPageTier | None = None) -> None:
        if capacity_bytes < 1:
            raise ValueError(f"capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.disk = disk  # where evicted blocks go; None: they are forgotten
        self.num_bytes = 0
        self.num_queried_blocks = 0  # by readers, for the node's metrics
        self.num_hit_blocks = 0  # of them, those read back (from either tier)
        self.num_disk_hit_blocks = 0  # of those, the ones read from disk
        self._blocks: OrderedDict[Key, StoredBlock] = OrderedDict()  # least recently used first
        self._reading: dict[Key, asyncio.Task] = {}  # taken from disk, not yet back in memory
        self._num_resets = 0  # a read that outlives a reset does not bring its block back
        # (fingerprint, hash) -> True: stored, False: evicted, since the last drain. A key's
        # events alternate, so a second one in a window undoes the first: at most one per key
        # stored now or at the last drain.
        self._events: dict[tuple[bytes, int], bool] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def enable_events(self) -> None:
        if self._events is None:
            self._events = {}

    def _record(self, key: tuple[bytes, int], is_added: bool) -> None:
        if self._events is not None and self._events.pop(key, None) is None:
            self._events[key] = is_added

    def drain_events(self) -> tuple[dict[bytes, list[int]], dict[bytes, list[int]]]:
        """(hashes stored, hashes evicted) by model fingerprint since the last drain, as net changes."""
        if not self._events:
            return {}, {}
        events, self._events = self._events, {}
        added: dict[bytes, list[int]] = {}
        removed: dict[bytes, list[int]] = {}
        for (fingerprint, h), is_added in events.items():
            (added if is_added else removed).setdefault(fingerprint, []).append(h)
        return added, removed

    def held(self) -> dict[bytes, list[int]]:
        """Every stored hash (on disk too), by model fingerprint."""
        held: dict[bytes, list[int]] = {}
        for fingerprint, h in [*self._blocks, *self._reading, *(self.disk.keys() if self.disk is not None else ())]:
            held.setdefault(fingerprint, []).append(h)
        return held

    def clear(self) -> int:
        """Forget every stored block, on disk too (a prefix-cache reset): the number forgotten, each
        one's removal recorded for the index as an eviction's is."""
        elsewhere = [*self._reading, *(self.disk.keys() if self.disk is not None else ())]
        for key in [*self._blocks, *elsewhere]:
            self._record(key, False)
        forgotten = len(self._blocks) + len(elsewhere)
        self._blocks.clear()
        self._num_resets += 1
        self.num_bytes = 0
        if self.disk is not None:
            self.disk.clear()
        return forgotten

    def put(self, block_hash: int, block: StoredBlock) -> None:
        """Store (or replace) a block as the most recently used, evicting the least recently
        used until it fits (the events say which, for the prefix index to forget).
        Raises ValueError for a block larger than the whole capacity (nothing is evicted then)."""
        size = block.pages.numel()
        if size > self.capacity_bytes:
            raise ValueError(f"a block of {size} bytes does not fit a tier of {self.capacity_bytes}")
        key = (block.layout.fingerprint, block_hash)
        old = self._blocks.pop(key, None)
        if old is not None:
            self.num_bytes -= old.pages.numel()
        was_held = old is not None or key in self._reading or (self.disk is not None and self.disk.discard(key))
        self._make_room(size)
        self._blocks[key] = block
        self.num_bytes += size
        if not was_held:
            self._record(key, True)

    def _make_room(self, size: int) -> None:
        """Evict the least recently used blocks until `size` bytes more fit: to disk, or forgotten."""
        while self.num_bytes + size > self.capacity_bytes:
            evicted_key, gone = self._blocks.popitem(last=False)
            self.num_bytes -= gone.pages.numel()
            if self.disk is None:
                self._record(evicted_key, False)
                continue
            for deleted in [*self.disk.put(evicted_key, gone.layout, gone.pages), *self.disk.take_lost()]:
                self._record(deleted, False)

    async def longest_prefix(self, fingerprint: bytes, block_hashes: list[int]) -> list[StoredBlock]:
        """The stored blocks of `block_hashes` up to the first one missing, each marked used; those on
        disk are read back into memory first."""
        self.num_queried_blocks += len(block_hashes)
        keys = []
        for h in block_hashes:
            key = (fingerprint, h)
            if key not in self._blocks and key not in self._reading and (self.disk is None or key not in self.disk):
                break
            keys.append(key)
        blocks = {key: self._blocks[key] for key in keys if key in self._blocks}  # a read may evict them
        if len(blocks) < len(keys):
            blocks |= await self._read_back([key for key in keys if key not in blocks])
        found = []
        for key in keys:
            if key not in blocks:
                break
            if key in self._blocks:
                self._blocks.move_to_end(key)
            found.append(blocks[key])
        self.num_hit_blocks += len(found)
        return found

    async def _read_back(self, keys: list[Key]) -> dict[Key, StoredBlock]:
        """The blocks of `keys` from disk (those not read by an earlier walk now, together), back in
        host memory; a block the disk lost is missing."""
        taken = [(key, self.disk.take(key)) for key in keys if key not in self._reading and key in self.disk]
        if taken:
            read = asyncio.ensure_future(self._load(taken))
            self._reading |= {key: read for key, _ in taken}
        blocks: dict[Key, StoredBlock] = {}
        for read in {self._reading[key] for key in keys}:  # each read once, however many of its keys
            blocks |= await asyncio.shield(read)  # a walk cancelled leaves the read to the others waiting
        return blocks

    async def _load(self, taken: list[tuple[Key, DiskRead]]) -> dict[Key, StoredBlock]:
        num_resets = self._num_resets
        try:
            pages = await asyncio.to_thread(lambda: [r.load() for _, r in taken])
        finally:
            for key, _ in taken:
                self._reading.pop(key, None)
        blocks = {}
        for (key, r), loaded in zip(taken, pages):
            if num_resets != self._num_resets:  # forgotten meanwhile
                continue
            if key in self._blocks:  # written again meanwhile
                blocks[key] = self._blocks[key]
                continue
            if loaded is None:
                self._record(key, False)
                continue
            blocks[key] = StoredBlock(r.layout, loaded)
            self._make_room(loaded.numel())
            self._blocks[key] = blocks[key]
            self.num_bytes += loaded.numel()
            self.num_disk_hit_blocks += 1
        return blocks
