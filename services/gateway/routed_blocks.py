"""`RoutedBlocks`: which prompt blocks this router sent to which prefill worker lately, an
approximation of what each worker's prefix cache holds (SGLang's router keeps one such
approximate tree per worker).

The last seconds of it say where a prompt's blocks are about to be: the index learns that
only once they are computed and published, and requests for the same prefix arriving
meanwhile (a burst) should follow the first instead of scattering (`leading`).

The router places a prompt that no worker holds much of on the worker with the fewest
blocks routed to it lately, so distinct prefixes spread evenly over the workers' caches.
Placing it by queue length instead piles prefixes onto whichever worker is idle at the
moment; once one worker has been sent more prefixes than it can keep, it evicts one,
the next request for that prefix finds only part of it there, recomputes the rest on
the same worker (the cheapest by compute), which evicts another: the caches thrash.

A block counts for the worker it was last routed to, for `window_s` after that; the
total is capped at `max_blocks`, the least recently routed forgotten first.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence


class RoutedBlocks:
    def __init__(self, window_s: float = 60.0, max_blocks: int = 1_000_000) -> None:
        self.window_s = window_s
        self.max_blocks = max_blocks
        self._blocks: OrderedDict[int, tuple[str, float]] = OrderedDict()  # hash -> (address, routed at)
        self._counts: dict[str, int] = {}

    def add(self, address: str, hashes: Sequence[int]) -> None:
        """`hashes` were just routed to `address`."""
        now = time.monotonic()
        for h in hashes:
            previous = self._blocks.pop(h, None)
            if previous is not None:
                self._counts[previous[0]] -= 1
            self._blocks[h] = (address, now)
            self._counts[address] = self._counts.get(address, 0) + 1
        self._forget(now)

    def leading(self, hashes: Sequence[int], within_s: float) -> dict[str, int]:
        """Leading blocks of `hashes` routed within the last `within_s` seconds, by worker."""
        horizon = time.monotonic() - within_s
        counts: dict[str, int] = {}
        for i, h in enumerate(hashes):
            entry = self._blocks.get(h)
            if entry is None or entry[1] < horizon:
                break
            if i == counts.get(entry[0], 0):  # still a leading run for that worker
                counts[entry[0]] = i + 1
        return counts

    def count(self, address: str) -> int:
        """Blocks routed to `address` within the window (and not routed elsewhere since)."""
        self._forget(time.monotonic())
        return self._counts.get(address, 0)

    def _forget(self, now: float) -> None:
        horizon = now - self.window_s
        while self._blocks:
            h, (address, routed_at) = next(iter(self._blocks.items()))
            if routed_at >= horizon and len(self._blocks) <= self.max_blocks:
                break
            del self._blocks[h]
            self._counts[address] -= 1
