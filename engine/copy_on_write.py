"""Copy-on-write of KV pages: a page that more than one sequence holds is never written. The
sequence about to write one gets a fresh page in its place, and the runner copies the shared page
into it before the next forward; the block manager hands those copies out as `CopyPairs`."""
from __future__ import annotations

from engine.block import Block
from engine.block_pool import BlockPool
from engine.sequence import Sequence

# (src_block, dst_block) page copies the runner must do before the next forward.
CopyPairs = list[tuple[int, int]]


def num_shared_to_write(blocks: list[Block], seq: Sequence, block_size: int) -> int:
    """The pages `seq` writes next (those of its uncomputed tokens) that others hold too: each needs
    a private copy."""
    to_write = seq.block_table[seq.num_computed_tokens // block_size :]
    return sum(1 for b in to_write if blocks[b].ref_count > 1)


def copy_shared_to_write(pool: BlockPool, seq: Sequence, block_size: int) -> CopyPairs:
    """Put a fresh page from `pool` in place of each page `seq` writes next that others hold too
    (`num_shared_to_write` of them); returns the (src, dst) copies."""
    table = seq.block_table
    copies: CopyPairs = []
    for i in range(seq.num_computed_tokens // block_size, len(table)):
        src = pool.blocks[table[i]]
        if src.ref_count > 1:  # copy-on-write
            src.ref_count -= 1
            table[i] = pool.take_free_block()
            copies.append((src.block_id, table[i]))
    return copies


def fork_block_table(pool: BlockPool, block_table: list[int], num_shared: int) -> tuple[list[int], CopyPairs]:
    """A forked child's block table: the first `num_shared` pages of its parent's `block_table`
    shared, each page after them copied into a fresh one from `pool`; and the (src, dst) copies."""
    table = block_table[:num_shared]
    for block_id in table:
        pool.blocks[block_id].ref_count += 1
    copies: CopyPairs = []
    for src in block_table[num_shared:]:
        table.append(pool.take_free_block())
        copies.append((src, table[-1]))
    return table, copies
