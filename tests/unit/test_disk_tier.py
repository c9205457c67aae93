"""A kvstore node's host tier over a disk tier: blocks host memory evicts go to disk (one file each,
written on the tier's own thread) and read back byte-exact into memory, leaving the disk, whether
their write is done or not; the disk's least recently used go when it is full, and only then does
the prefix index hear that the node let them go (or when a write fails); a reset empties both."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest
import torch

from services.kvstore.disk_tier import DiskPageTier
from services.kvstore.host_tier import HostPageTier, StoredBlock
from services.kvstore.layout import PageLayout

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, block_size=4, head_dim=8, dtype="float32", num_blocks=1,
                    fingerprint=b"\x05" * 32)
BLOCK_BYTES = 2 * 2 * 2 * 4 * 8 * 4  # [L, 2*Hkv, bs*D*itemsize] of uint8


def block(seed: int) -> StoredBlock:
    pages = torch.randint(0, 256, (2, 4, 4 * 8 * 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return StoredBlock(LAYOUT, pages)


def longest_prefix(tier: HostPageTier, block_hashes: list[int]) -> list[StoredBlock]:
    return asyncio.run(tier.longest_prefix(LAYOUT.fingerprint, block_hashes))


@pytest.fixture
def tiers(tmp_path):
    disk = DiskPageTier(tmp_path / "kv", capacity_bytes=3 * BLOCK_BYTES)
    tier = HostPageTier(2 * BLOCK_BYTES, disk)
    tier.enable_events()
    return tier, disk, tmp_path / "kv"


def test_evicted_blocks_go_to_disk_and_read_back_exactly(tiers):
    tier, disk, directory = tiers
    written = {h: block(h) for h in range(5)}
    for h, stored in written.items():
        tier.put(h, stored)
    assert tier.num_blocks == 2 and disk.num_blocks == 3 and disk.num_bytes == 3 * BLOCK_BYTES
    disk.flush()
    assert len(list(directory.iterdir())) == 3
    added, removed = tier.drain_events()
    assert sorted(added[LAYOUT.fingerprint]) == [0, 1, 2, 3, 4] and removed == {}  # all still on the node
    assert sorted(tier.held()[LAYOUT.fingerprint]) == [0, 1, 2, 3, 4]
    found = longest_prefix(tier, [0, 1, 2, 3, 4, 9])
    assert [torch.equal(f.pages, written[h].pages) for h, f in zip(range(5), found)] == [True] * 5
    # The three on disk came back together, pushing out the two memory held (whose pages were at hand).
    assert tier.num_disk_hit_blocks == 3 and tier.num_hit_blocks == 5
    # Read back into memory, each went to the front; the others went to disk in their place: still five.
    disk.flush()
    assert tier.num_blocks + disk.num_blocks == 5 and len(list(directory.iterdir())) == disk.num_blocks
    assert tier.drain_events() == ({}, {})


def test_the_disks_least_recently_used_leave_the_node(tiers):
    tier, disk, _ = tiers
    for h in range(5):  # two in memory, three on disk
        tier.put(h, block(h))
    tier.drain_events()
    tier.put(5, block(5))  # the first one written goes
    assert tier.drain_events() == ({LAYOUT.fingerprint: [5]}, {LAYOUT.fingerprint: [0]})
    assert longest_prefix(tier, [0, 1]) == []
    tier.put(3, block(30))  # rewritten: on disk no more, in memory once (no event: it never left)
    assert 3 not in [h for _, h in disk.keys()] and tier.drain_events()[0] == {}
    assert torch.equal(longest_prefix(tier, [3])[0].pages, block(30).pages)


def test_a_reset_forgets_both_tiers(tiers):
    tier, disk, directory = tiers
    for h in range(4):
        tier.put(h, block(h))
    tier.drain_events()
    assert tier.clear() == 4
    disk.flush()
    assert tier.num_blocks == disk.num_blocks == disk.num_bytes == 0 and list(directory.iterdir()) == []
    assert sorted(tier.drain_events()[1][LAYOUT.fingerprint]) == [0, 1, 2, 3]


def test_pages_left_from_an_earlier_run_are_deleted_and_nothing_else(tmp_path):
    (tmp_path / "stale.kv").write_bytes(b"x" * 10)
    (tmp_path / "notes.txt").write_text("mine")
    assert [p.name for p in DiskPageTier(tmp_path, 1024).directory.iterdir()] == ["notes.txt"]


def test_a_block_read_back_while_its_write_is_queued_is_its_pages(tmp_path):
    disk = DiskPageTier(tmp_path, capacity_bytes=4 * BLOCK_BYTES)
    release = threading.Event()
    disk._writer.submit(release.wait)  # the writer is busy: what follows waits behind it
    disk.put((LAYOUT.fingerprint, 7), LAYOUT, block(7).pages)
    layout, pages = disk.take((LAYOUT.fingerprint, 7))[:2]
    assert layout == LAYOUT and torch.equal(pages, block(7).pages) and disk.num_bytes == 0
    release.set()
    disk.flush()
    assert list(tmp_path.iterdir()) == []  # written, then deleted, in that order


def test_a_block_whose_write_fails_leaves_the_node(tmp_path):
    disk = DiskPageTier(tmp_path / "kv", capacity_bytes=4 * BLOCK_BYTES)
    tier = HostPageTier(BLOCK_BYTES, disk)
    tier.enable_events()
    tier.put(1, block(1))
    tier.drain_events()
    (tmp_path / "kv").rmdir()  # the disk went away
    tier.put(2, block(2))  # 1 goes to a disk that cannot take it
    disk.flush()
    tier.put(3, block(3))  # 2 goes too; the failure of 1 is heard of now
    assert tier.drain_events()[1] == {LAYOUT.fingerprint: [1]}
    assert longest_prefix(tier, [1]) == []


def _block_zero_behind_a_pipe(tier: HostPageTier, disk: DiskPageTier, directory) -> threading.Event:
    """Block 0 on disk, its file a named pipe that gives its bytes only once the returned event is
    set (or after 5 s, so that a read that blocks the event loop ends): until then, reading it
    blocks whoever reads."""
    for h in range(3):  # 0 goes to disk
        tier.put(h, block(h))
    disk.flush()
    (path,) = directory.glob("*.kv")
    data = path.read_bytes()
    path.unlink()
    os.mkfifo(path)

    go = threading.Event()

    def feed() -> None:
        go.wait(timeout=5)
        with open(path, "wb") as pipe:
            pipe.write(data)
    threading.Thread(target=feed, daemon=True).start()
    return go


def test_a_read_from_disk_leaves_the_event_loop_to_other_requests(tiers):
    tier, disk, directory = tiers
    go = _block_zero_behind_a_pipe(tier, disk, directory)

    async def walks() -> tuple[int, list[StoredBlock]]:
        first = asyncio.create_task(tier.longest_prefix(LAYOUT.fingerprint, [0, 1]))
        await asyncio.sleep(0.01)
        second = asyncio.create_task(tier.longest_prefix(LAYOUT.fingerprint, [0]))
        ticks = 0
        while ticks < 20:  # the loop keeps turning while block 0 is read
            await asyncio.sleep(0.005)
            ticks += 1
        assert not second.done() and 0 in tier.held()[LAYOUT.fingerprint]  # not gone from the node meanwhile
        first.cancel()  # the first walk's client went away: the read goes on for the second
        go.set()
        found = await asyncio.wait_for(second, timeout=10)
        return ticks, found

    ticks, found = asyncio.run(walks())
    assert ticks == 20 and len(found) == 1 and torch.equal(found[0].pages, block(0).pages)
    assert tier.num_disk_hit_blocks == 1 and tier.num_blocks == 2 and disk.num_blocks == 1  # 1 went down for it
    assert list(tier.drain_events()[1]) == []  # nothing left the node


def test_a_reset_while_a_block_is_read_back_forgets_it(tiers):
    tier, disk, directory = tiers
    go = _block_zero_behind_a_pipe(tier, disk, directory)
    tier.drain_events()

    async def walk_across_a_reset() -> list[StoredBlock]:
        walk = asyncio.create_task(tier.longest_prefix(LAYOUT.fingerprint, [0, 1]))
        await asyncio.sleep(0.05)
        assert tier.clear() == 3
        go.set()
        return await asyncio.wait_for(walk, timeout=10)

    assert asyncio.run(walk_across_a_reset()) == []
    assert tier.num_blocks == 0 and tier.held() == {}
    assert sorted(tier.drain_events()[1][LAYOUT.fingerprint]) == [0, 1, 2]
