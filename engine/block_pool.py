"""`BlockPool`: the KV pages nobody holds, handed out as fresh pages (vLLM's block pool)."""
from __future__ import annotations

from collections.abc import Sequence as TokenIds

from engine.block import Block
from engine.free_queue import FreeQueue
from engine.prefix_cache import PrefixCache


class BlockPool:
    """Takes free pages of `blocks` out of their queue, each held once.

    Contract: a `take_*` hands out pages with ref_count 1 and no cached content, in ascending id
    order, or raises RuntimeError before changing anything when too few are free. A page that
    `prefix_cache` names is forgotten there only now that it is reused (lazy eviction). Whoever
    drops a page's last reference pushes it back to `free_block_ids`.
    """

    def __init__(self, blocks: list[Block], prefix_cache: PrefixCache) -> None:
        self.blocks = blocks
        self.free_block_ids = FreeQueue(blocks)
        self.prefix_cache = prefix_cache

    def take_free_block(self) -> int:
        """The next block to evict: a single page has no run to keep."""
        return self.take_free_blocks(1)[0]

    def _claim(self, block_id: int) -> int:
        """Take free `block_id` out of the queue as a page held once."""
        self.free_block_ids.remove(block_id)
        block = self.blocks[block_id]
        if block.hash is not None:
            # Lazy eviction: the cached content is forgotten only now that the page is reused.
            self.prefix_cache.evict(block)
        block.chances = 0
        block.ref_count = 1
        return block_id

    def take_free_blocks(self, n: int) -> list[int]:
        """The next `n` blocks to evict, in ascending id order. Which pages a prompt gets
        does not matter to the cache; their order does to copies of them: ascending ids on both
        ends of a KV transfer make runs that copy as one slice each."""
        if n > len(self.free_block_ids):
            raise RuntimeError("no free KV block: check can_allocate/can_append_slot first")
        return sorted(self._claim(b) for b in self.free_block_ids.next_to_evict(n))

    def take_free_runs(self, n: int) -> list[int]:
        """`n` free blocks in few runs of consecutive ids (`FreeQueue.next_in_runs`), ascending:
        for a reservation, which a KV transfer fills."""
        num_free = len(self.free_block_ids)
        if n > num_free:
            raise RuntimeError(f"{n} free KV blocks wanted, {num_free} free: check can_reserve first")
        return sorted(self._claim(b) for b in self.free_block_ids.next_in_runs(n))

    def import_cached_blocks(self, token_ids: TokenIds[int], first_block: int, num_blocks: int,
                             cache_salt: str | None = None) -> list[tuple[int, int]]:
        """Fresh pages named as cached blocks of `token_ids`, left free: the contract of
        `BlockManager.import_cached_blocks`."""
        if not self.prefix_cache.is_enabled or num_blocks < 1:
            return []
        matched, hashes = self.prefix_cache.match(token_ids, first_block, cache_salt=cache_salt)
        if len(matched) < first_block:
            return []
        # The prefix these blocks extend leaves the queue while fresh pages are taken (so none of
        # it is evicted for them), then goes back to its tail.
        revived = [b for b in matched if self.blocks[b].ref_count == 0]
        for block_id in revived:
            self.free_block_ids.remove(block_id)
        stop_block = min(first_block + num_blocks, len(token_ids) // self.prefix_cache.block_size)
        wanted = self.prefix_cache.uncached_blocks(token_ids, first_block, stop_block, hashes[-1] if hashes else None,
                                                   cache_salt)
        wanted = wanted[: len(self.free_block_ids)]
        named = list(zip((i for i, _, _, _ in wanted), self.take_free_blocks(len(wanted))))
        for block_id in revived:
            self.free_block_ids.push(block_id)
        for (_, h, tokens, parent), (_, block_id) in zip(wanted, named):
            self.blocks[block_id].ref_count = 0
            self.prefix_cache.cache(self.blocks[block_id], h, tokens, None, parent)
        # Back into the free queue tail first, as `free` does: a prefix's tail is evicted before its head.
        for _, block_id in reversed(named):
            self.free_block_ids.push(block_id)
        return named
