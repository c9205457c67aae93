"""What a hybrid model's prefix cache needs beside cached KV blocks: the recurrent states at the end of a cached
prefix (engine/recurrent_state.py), which no page of the prefix holds. A prompt continues from a cached prefix only
where the states at its end were kept, so the prefix cache's match is cut back to the longest such prefix
(BlockManager, `snapshots`).

A sequence's states are kept when they stand at a block's end: at the end of a prompt's chunk that ends on one,
and, for the output, the last such place before the sequence finishes (a conversation's next turn starts there).
They are kept in host memory, least recently used first out, within a byte budget, by the chain hash of the
prefix's last block (which names every token before it, and the adapter and salt it was computed with).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.sequence import Sequence


class StateSnapshots:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, block_hash: int) -> torch.Tensor | None:
        """The states kept at the prefix ending in block `block_hash`, now the most recently used; None if none."""
        rows = self._rows.get(block_hash)
        if rows is not None:
            self._rows.move_to_end(block_hash)
        return rows

    def put(self, block_hash: int, rows: torch.Tensor) -> None:
        """Keep `rows` (one sequence's states) for the prefix ending in block `block_hash`, a copy in host memory;
        the least recently used go to make room (none kept where one alone is over the budget)."""
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or block_hash in self._rows:
            return
        while self.num_bytes + size > self.max_bytes:
            _, dropped = self._rows.popitem(last=False)
            self.num_bytes -= dropped.numel() * dropped.element_size()
        self._rows[block_hash] = rows.to("cpu", copy=True)
        self.num_bytes += size

    def clear(self) -> None:
        self._rows.clear()
        self.num_bytes = 0


def keep_state_snapshots(seqs: list[Sequence], block_manager: BlockManager, snapshots: StateSnapshots) -> None:
    """After a step (its blocks cached): each of `seqs` keeps its states at the block ends of its step, at once in
    its prompt, else as its pending snapshot (kept when it finishes, the last such one)."""
    for seq in seqs:
        for index, rows in seq.boundary_states:
            block_hash = block_manager.block_hash(seq, index)
            if block_hash is None:
                continue
            if (index + 1) * block_manager.block_size <= seq.num_prompt_tokens:
                snapshots.put(block_hash, rows)
            else:
                seq.pending_snapshot = (block_hash, rows)
        seq.boundary_states = []
