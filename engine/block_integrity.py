"""`check_block_integrity`: the invariants that tie the block manager's pages together. Each page
is held as many times as its reference count says (by sequences' block tables and by reservations),
sits in the free queue exactly when nobody holds it, and holds no other block than the one a
sequence's hash chain names for it."""
from __future__ import annotations

from collections.abc import Mapping

from engine.block import Block
from engine.free_queue import FreeQueue
from engine.sequence import Sequence


def check_block_integrity(blocks: list[Block], free_block_ids: FreeQueue, seqs: Mapping[str, Sequence],
                          seq_hashes: Mapping[str, list[int]], reserved: Mapping[str, list[int]],
                          num_state_blocks: int = 0) -> None:
    """Raise AssertionError naming the first inconsistency between pages, tables and map: `seqs` hold
    pages by their block tables (and `num_state_blocks` each for their states), `seq_hashes` are their chain
    hashes, `reserved` each reservation's pages."""
    held_by = [0] * len(blocks)
    assert seq_hashes.keys() == seqs.keys(), "hash chains and held sequences disagree"
    for rid, seq in seqs.items():
        table, hashes = seq.block_table, seq_hashes[rid]
        assert len(set(table)) == len(table), f"{rid!r} holds a block twice: {table}"
        assert len(hashes) <= len(table), f"{rid!r}: {len(hashes)} hashes for {len(table)} blocks"
        for block_id, h in zip(table, hashes):
            assert blocks[block_id].hash in (None, h), f"{rid!r}: block {block_id} has another hash"
        assert len(seq.state_blocks) == num_state_blocks, f"{rid!r} holds {len(seq.state_blocks)} state blocks"
        assert not set(seq.state_blocks) & set(table), f"{rid!r}: a state block is in its block table"
        for block_id in (*table, *seq.state_blocks):
            held_by[block_id] += 1
    for rid, block_ids in reserved.items():
        assert rid not in seqs, f"{rid!r} is both reserved and held by a sequence"
        for block_id in block_ids:
            held_by[block_id] += 1
    for block in blocks:
        b, ref, is_free = block.block_id, block.ref_count, block.block_id in free_block_ids
        assert ref == held_by[b], f"block {b}: ref_count {ref} but held by {held_by[b]} tables"
        assert (ref == 0) == is_free, f"block {b}: ref_count {ref} but in free queue: {is_free}"
    # The queue's ids are unique (an OrderedDict's keys), so no id is queued twice; the count rules out
    # unknown ids.
    assert len(free_block_ids) == held_by.count(0), "free queue holds unknown block ids"
