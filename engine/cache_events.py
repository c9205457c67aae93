"""`CacheEvents`: how a prefix cache's set of block hashes changed since it was last read, for a
prefix index outside the process (services/common/index_publisher.py)."""
from __future__ import annotations


class CacheEvents:
    """Net changes (hash -> True: added, False: removed). Bounded even if nobody drains: an added
    hash is cached now, a removed one was at the last drain, so it holds at most twice as many
    entries as the cache has blocks."""

    def __init__(self) -> None:
        self._changes: dict[int, bool] = {}

    def __len__(self) -> int:
        return len(self._changes)

    def items(self):
        """(hash, is_added) of each change not drained yet."""
        return self._changes.items()

    def record(self, h: int, is_added: bool) -> None:
        # A hash enters the cache only when absent and leaves only when present, so its events
        # alternate: a second one in the same window undoes the first.
        if self._changes.pop(h, None) is None:
            self._changes[h] = is_added

    def drain(self) -> tuple[list[int], list[int]]:
        """(hashes added, hashes removed) since the last drain: a hash added and evicted in
        between is in neither list."""
        changes, self._changes = self._changes, {}
        added = [h for h, is_added in changes.items() if is_added]
        return added, [h for h, is_added in changes.items() if not is_added]
