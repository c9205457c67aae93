"""`FreeQueue`: the KV pages nobody holds, in the order they are reused.

Least recently freed first (a freed page may still hold a cached prefix, evicted only
when the page is reused), except that a cached page that served prefix hits is passed
over while it has chances left (GCLOCK). `next_in_runs` picks pages in runs of
consecutive ids (`fewest_runs`), for a reservation that a KV transfer fills.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol

# How many passes of the free queue a block that keeps serving prefix hits survives unhit
# (GCLOCK's counter cap): enough for a prefix hit every few requests to stay cached while
# the one-off blocks around it go, few enough that a prefix gone cold leaves within a few passes.
MAX_CHANCES = 3


class HasChances(Protocol):
    chances: int


class FreeQueue:
    """The free block ids of `blocks` (all of them at first), head first."""

    def __init__(self, blocks: Sequence[HasChances]) -> None:
        self._blocks = blocks
        # An OrderedDict: O(1) pop at the head, push at the tail, and removal from the middle
        # when a prefix hit revives a cached block.
        self._ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(len(blocks)))

    def __len__(self) -> int:
        return len(self._ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._ids

    def push(self, block_id: int) -> None:
        """`block_id` is free now: to the tail, the last to be reused."""
        self._ids[block_id] = None

    def remove(self, block_id: int) -> None:
        """`block_id` is held again (taken, or revived by a prefix hit)."""
        del self._ids[block_id]

    def next_to_evict(self, n: int) -> list[int]:
        """The first `n` free blocks in eviction order (at most the free count): least recently
        freed first, except that a block with chances left is passed over, losing one and going
        to the back of the queue. Nothing is removed.

        Why: under strict LRU a hot prefix that no request holds at the moment sits behind the
        fresh blocks of newer requests, most of which (a user's own suffix, a partial block) are
        never hit again, and near a full pool it is evicted before them (bench/prefix_routing.py:
        two prefill pools that each hold about half the system prompts). Counting hits (up to
        MAX_CHANCES) rather than one bit matters there: one pass over a pool full of hot prefixes
        would clear every bit, and the next evict them in plain LRU order. A block hit once
        survives at most MAX_CHANCES passes without another hit, so no prefix pins its pages.
        """
        chosen: list[int] = []
        taken: set[int] = set()
        while len(chosen) < n:  # a pass that chose too few left every other block a chance less
            spared: list[int] = []
            for block_id in self._ids:
                if len(chosen) == n:
                    break
                if block_id in taken:
                    continue
                if self._blocks[block_id].chances:
                    spared.append(block_id)
                else:
                    chosen.append(block_id)
                    taken.add(block_id)
            for block_id in spared:
                self._blocks[block_id].chances -= 1
                self._ids.move_to_end(block_id)
        return chosen

    def next_in_runs(self, n: int) -> list[int]:
        """`n` free blocks (no more than are free) in few runs of consecutive ids, in eviction
        order: for a reservation, which a KV transfer fills. Nothing is removed.

        Why: a transfer copies one slice per run consecutive on both ends (`page_copy.block_runs`),
        and in the `[L, 2, Hkv, N, bs, D]` pool a block is only bs*D*itemsize bytes per (layer,
        K/V, head) row, so a scattered list becomes many small copies. Strict LRU scatters them:
        requests free their pages at different times, so the queue head mixes ids from everywhere
        (bench/mesh_overhead.py, after its TTFT traffic: 64 MiB into 9 decode reservations took
        61 runs, 46 this way. Copying 1024 demo-model blocks into a shared-memory pool, 61 runs
        measured 0.58-0.73 of a memcpy against 0.73-0.87 for one run, on a quiet host).

        Policy: the candidates are the next 2n blocks in eviction order; of them, whole runs are
        taken longest first, then the shortest run that covers the rest (ties: the run holding
        the older block); when no two candidates are consecutive this is exactly the next n.
        Only reservations look this deep: a prompt's own pages come strictly from the head, so the
        prefix cache never loses a block that the eviction order would keep.
        """
        if n <= 1:
            return self.next_to_evict(n)
        candidates = self.next_to_evict(min(2 * n, len(self._ids)))
        chosen = set(fewest_runs(candidates, n))
        # Least recently freed first, the order strict LRU would evict them in.
        return [block_id for block_id in candidates if block_id in chosen]


def fewest_runs(candidates: list[int], n: int) -> list[int]:
    """`n` of `candidates` (distinct block ids, oldest first) in few runs of consecutive ids:
    whole runs longest first, then the shortest run that covers the rest, cut to its oldest
    stretch; equal lengths go to the run holding the older block."""
    age = {b: i for i, b in enumerate(candidates)}
    runs: list[tuple[int, int, int]] = []  # (length, age of its oldest block, first id)
    for b in sorted(candidates):
        if runs and runs[-1][2] + runs[-1][0] == b:
            length, oldest, first = runs[-1]
            runs[-1] = (length + 1, min(oldest, age[b]), first)
        else:
            runs.append((1, age[b], b))
    runs.sort(key=lambda run: (-run[0], run[1]))
    taken: list[int] = []
    for i, (length, _, first) in enumerate(runs):
        rest = n - len(taken)
        if length < rest:
            taken.extend(range(first, first + length))
            continue
        # runs[i:] descend in length: the shortest that covers the rest, oldest first.
        length = min(run[0] for run in runs[i:] if run[0] >= rest)
        first = next(run[2] for run in runs[i:] if run[0] == length)
        # Of its `rest`-long stretches, the oldest (least sum of ages).
        ages = [age[b] for b in range(first, first + length)]
        window = best = sum(ages[:rest])
        start = 0
        for j in range(rest, length):
            window += ages[j] - ages[j - rest]
            if window < best:
                best, start = window, j - rest + 1
        taken.extend(range(first + start, first + start + rest))
        return taken
    raise ValueError(f"{len(candidates)} candidates cannot give {n} blocks")
